"""Matmuls of one token (GEMV): a Triton kernel that streams the weight matrix at close to the
device's bandwidth, for the decode steps of a single request.

At one token a linear layer is a matrix-vector product whose time is the time to read its
weights. cuBLAS serves these shapes with GEMM tiles (and split-K plus a reduce kernel for the
square ones); on the H200 that reads Qwen3-8B's attention and down projections at 2.7-3.4 TB/s
(benchmarks/gemv.py). The kernel here gives each program a few weight rows, reads them in long
contiguous chunks and reduces in float32, with no second kernel.

A model built for serving on CUDA (flare_core.ops.serving.gemv_layers) has its bias-free linear
layers as `GemvLinear` (flare_core.ops.linear), whose calls of up to FEW_TOKENS tokens go to the
custom op `flare::linear`: on a CUDA device this kernel for one token, `gemv_tokens` (below) for a
few, for the shapes they take, `F.linear` otherwise. Being an op, it is one opaque
node in compiled layers and a launch that CUDA graphs capture like any other. `FusedGatedMLP`
calls `flare::gated_linear`, which also applies silu(gate) * up in the kernel, and
`DecoderForServing` the head through `flare::linear`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: every call takes the F.linear path
    triton = None


@dataclass(frozen=True)
class GemvConfig:
    """Weight rows per program, columns per loop iteration, warps per program, pipeline stages,
    and whether the kernel launches as a programmatic dependent (`pdl`, below)."""

    rows: int
    columns: int
    warps: int
    stages: int
    pdl: bool = False


@functools.cache
def _pdl(device_index: int) -> bool:
    """Programmatic dependent launch: Hopper and later, with a Triton that can launch it. The
    kernel then starts while the one before it finishes and loads its first weights meanwhile."""
    if triton is None or torch.cuda.get_device_capability(device_index)[0] < 9:
        return False
    from triton.backends.nvidia.compiler import CUDAOptions

    return "launch_pdl" in CUDAOptions.__dataclass_fields__ and hasattr(tl.extra.cuda, "gdc_wait")


def gemv_config(out_features: int, in_features: int, gated: bool = False, pdl: bool = False) -> GemvConfig | None:
    """The launch configuration for a [out_features, in_features] weight (gated: twice as many
    rows), or None when the kernel does not take the shape (then `F.linear` runs). The figures
    below are the H200's (benchmarks/gemv.py: Qwen3-8B's shapes in
    benchmarks/results/h200-gemv-sweep.json, Kimi Linear's in h200-gemv-kimi-linear.json).

    * Matrices of fewer than 1,024 rows (MoE routers, MLA's latent projection), or of fewer than
      2,048 over an input of no multiple of 1,024 features, take one row per program, so that
      their few rows still spread over the device's 132 SMs, and the widest tile of 1,024 (gated
      2,048) to 128 columns that divides the input (Kimi Linear's gated shared expert, 2 x 1,024
      rows over 2,304: 5.1 us against 7.2 with 4 rows of 128 columns).
    * Inputs of a multiple of 1,024 features: 1,024 columns per iteration (2,048 for the gated
      kernel, which reads two tiles per iteration), four warps; 16 rows per program for matrices
      of at most 4,096 rows that still give 256 programs, else 2. These were the best, or within
      2 %, of the sweep on every such shape; 16 rows over 2,304 (144 programs, one wave and a
      few) took 8.2 us against 6.6 with 2.
    * Other inputs (Kimi Linear's 2,304 features, its gates' 128): 128 columns per iteration,
      eight warps, 16 rows per program, halved to no fewer than 4 while that leaves fewer than
      512 programs: the best or within 2 % of the sweep on those shapes, where the 256-column
      tiles took 2.3-2.9 TB/s against 3.0-3.5."""
    if out_features < 1024 or (out_features < 2048 and in_features % 1024):
        for columns in ((2048, 1024, 512, 256, 128) if gated else (1024, 512, 256, 128)):
            if in_features % columns == 0:
                return GemvConfig(rows=1, columns=columns, warps=4, stages=1, pdl=pdl)
        return None
    columns = 2048 if gated and in_features % 2048 == 0 else 1024
    if in_features % columns == 0:
        rows = 16 if out_features <= 4096 and out_features // 16 >= 256 else 2
        return GemvConfig(rows=rows, columns=columns, warps=4, stages=1, pdl=pdl)
    if in_features % 128 == 0:
        rows = 16
        while rows > 4 and out_features // rows < 512:
            rows //= 2
        return GemvConfig(rows=rows, columns=128, warps=8, stages=1, pdl=pdl)
    return None


if triton is not None:
    # N stays a runtime argument: Triton would make an N of 1 (Qwen3-Next's shared-expert gate, one
    # row) a Python constant, on which `.to` fails.
    @triton.jit(do_not_specialize=["N"])
    def _gemv_kernel(x_ptr, w_ptr, out_ptr, N, K, ROWS: tl.constexpr, COLUMNS: tl.constexpr, GATED: tl.constexpr,
                     PDL: tl.constexpr):
        # Program p reads weight rows [p * ROWS, (p + 1) * ROWS) (and, gated, the up rows N below
        # them) across all K columns, COLUMNS at a time; x is small and stays in L2.
        if PDL:  # the kernel after this one may start now: it waits for our output itself
            tl.extra.cuda.gdc_launch_dependents()
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        row_mask = rows[:, None] < N
        columns = tl.arange(0, COLUMNS)
        offsets = rows[:, None].to(tl.int64) * K + columns[None, :]
        up_shift = N.to(tl.int64) * K
        # The weights do not depend on the kernel before: the first columns load while it ends.
        w = tl.load(w_ptr + offsets, mask=row_mask, other=0.0)
        up = tl.load(w_ptr + offsets + up_shift, mask=row_mask, other=0.0) if GATED else w
        if PDL:  # x is the previous kernel's output
            tl.extra.cuda.gdc_wait()
        x = tl.load(x_ptr + columns).to(tl.float32)
        acc = w.to(tl.float32) * x[None, :]
        up_acc = up.to(tl.float32) * x[None, :]
        for start in range(COLUMNS, K, COLUMNS):
            x = tl.load(x_ptr + start + columns).to(tl.float32)
            w = tl.load(w_ptr + offsets + start, mask=row_mask, other=0.0)
            acc += w.to(tl.float32) * x[None, :]
            if GATED:
                up = tl.load(w_ptr + offsets + up_shift + start, mask=row_mask, other=0.0)
                up_acc += up.to(tl.float32) * x[None, :]
        y = tl.sum(acc, axis=1)
        if GATED:  # silu(gate) * up
            y = y * tl.sigmoid(y) * tl.sum(up_acc, axis=1)
        tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=rows < N)


def gemv(x: Tensor, weight: Tensor, config: GemvConfig, gated: bool = False,
         out_dtype: torch.dtype | None = None) -> Tensor:
    """x [K] @ weight[N, K]^T -> [N] in `out_dtype` (default x's; the sums are float32 either
    way) (gated: weight is [2N, K], gate rows first, and the result is silu(gate) * up, [N])."""
    out_features = weight.shape[0] // 2 if gated else weight.shape[0]
    out = x.new_empty(out_features, dtype=out_dtype)
    _gemv_kernel[(triton.cdiv(out_features, config.rows),)](
        x, weight, out, out_features, weight.shape[1], ROWS=config.rows, COLUMNS=config.columns, GATED=gated,
        PDL=config.pdl, num_warps=config.warps, num_stages=config.stages, launch_pdl=config.pdl)
    return out


# Matmuls of a few tokens (a speculative round's row and drafts, a decode batch of a few rows):
# cuBLAS's GEMM tiles read Qwen3-8B's weights for 2 to 18 tokens in 7.0 ms on the H100 where the
# one-token kernel above takes 6.06 (benchmarks/results/h100-speculative-round.json). The kernel
# below keeps the one-token kernel's plan — each program streams a few weight rows over all K —
# and multiplies each tile with every token at once on the tensor cores (tl.dot over up to
# FEW_TOKENS tokens, the missing ones masked to zero).
FEW_TOKENS = 16


@dataclass(frozen=True)
class FewTokensConfig:
    """Weight rows per program (at least 16, tl.dot's least), columns per loop iteration, warps
    per program and pipeline stages of `gemv_tokens`."""

    rows: int
    columns: int
    warps: int
    stages: int


if triton is not None:
    @triton.jit(do_not_specialize=["M", "N"])
    def _few_tokens_kernel(x_ptr, w_ptr, out_ptr, M, N, K, TOKENS: tl.constexpr, ROWS: tl.constexpr,
                           COLUMNS: tl.constexpr, GATED: tl.constexpr):
        # Program p reads weight rows [p * ROWS, (p + 1) * ROWS) (gated: and the up rows N below
        # them) across all K columns, COLUMNS at a time, and multiplies each tile with the M tokens'
        # columns there (rows past M load as zeros): [TOKENS, COLUMNS] x [COLUMNS, ROWS].
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        tokens = tl.arange(0, TOKENS)
        columns = tl.arange(0, COLUMNS)
        row_mask = rows[:, None] < N
        token_mask = tokens[:, None] < M
        w_at = w_ptr + rows[:, None].to(tl.int64) * K + columns[None, :]
        x_at = x_ptr + tokens[:, None].to(tl.int64) * K + columns[None, :]
        up_shift = N.to(tl.int64) * K
        acc = tl.zeros([TOKENS, ROWS], dtype=tl.float32)
        up_acc = tl.zeros([TOKENS, ROWS], dtype=tl.float32)
        for start in range(0, K, COLUMNS):
            x = tl.load(x_at + start, mask=token_mask, other=0.0)
            w = tl.load(w_at + start, mask=row_mask, other=0.0)
            acc = tl.dot(x, tl.trans(w), acc)
            if GATED:
                up = tl.load(w_at + up_shift + start, mask=row_mask, other=0.0)
                up_acc = tl.dot(x, tl.trans(up), up_acc)
        if GATED:  # silu(gate) * up
            acc = acc * tl.sigmoid(acc) * up_acc
        out_at = out_ptr + tokens[:, None].to(tl.int64) * N + rows[None, :]
        tl.store(out_at, acc.to(out_ptr.dtype.element_ty), mask=token_mask & (rows[None, :] < N))


def gemv_tokens(x: Tensor, weight: Tensor, config: FewTokensConfig, gated: bool = False) -> Tensor:
    """x [M, K] @ weight[N, K]^T -> [M, N] for 1 <= M <= FEW_TOKENS, K a multiple of
    `config.columns` (gated: weight is [2N, K], gate rows first, and the result silu(gate) * up,
    [M, N]); float32 sums, x's dtype out."""
    tokens, in_features = x.shape
    assert 1 <= tokens <= FEW_TOKENS and in_features % config.columns == 0 and x.is_contiguous()
    out_features = weight.shape[0] // 2 if gated else weight.shape[0]
    out = x.new_empty(tokens, out_features)
    _few_tokens_kernel[(triton.cdiv(out_features, config.rows),)](
        x, weight, out, tokens, out_features, in_features, TOKENS=FEW_TOKENS, ROWS=config.rows,
        COLUMNS=config.columns, GATED=gated, num_warps=config.warps, num_stages=config.stages)
    return out


def one_token_on_gpu(x: Tensor, weight: Tensor, weight_dtype: torch.dtype) -> bool:
    """Whether x is one 16-bit token on a CUDA device, for a contiguous weight of `weight_dtype`:
    the calls a one-token Triton kernel (this module's, flare_core.kernels.fp8's) may take."""
    return _tokens_on_gpu(x, weight, weight_dtype) == 1


def _tokens_on_gpu(x: Tensor, weight: Tensor, weight_dtype: torch.dtype) -> int:
    """The tokens x holds when they are 16-bit on a CUDA device, for a contiguous weight of
    `weight_dtype`; 0 for a call no Triton kernel here takes."""
    if (triton is None or not x.is_cuda or x.dtype not in (torch.bfloat16, torch.float16)
            or weight.dtype != weight_dtype or not weight.is_contiguous()):
        return 0
    return x.numel() // weight.shape[1]


def few_tokens_config(out_features: int, in_features: int, gated: bool = False) -> FewTokensConfig | None:
    """The launch configuration of `gemv_tokens` for a [out_features, in_features] weight (gated:
    twice as many rows), or None where cuBLAS keeps the call. On the H100 (benchmarks/gemv.py
    --tokens 2,5,8,16 over Qwen3-8B's shapes, benchmarks/results/h100-gemv-tokens.json, which
    keeps each shape's four best of the sweep): 32 rows per program, 4 warps, 256 columns per
    iteration over 4 stages was the best on o_proj (14.0 us at 2 tokens against cuBLAS's 15.9)
    and down_proj (37.0 against 38.0); on qkv_proj and lm_head it was not among the four best,
    which lay within 1.2 % and 0.6 % of one another and all but one under cuBLAS (qkv_proj 19.4-19.7
    us against 19.7, lm_head 393-394 against 412). The gated kernel, which reads two tiles per
    iteration: 128 columns over 3 stages (66.6 us against 74.7 for cuBLAS's matmul and
    silu(gate) * up). Matrices of fewer than 1,024 rows (routers, gates) were not measured and
    stay with cuBLAS."""
    if out_features < 1024:
        return None
    for columns in ((128,) if gated else (256, 128)):
        if in_features % columns == 0:
            return FewTokensConfig(rows=32, columns=columns, warps=4, stages=3 if gated else 4)
    return None


def _kernel_config(x: Tensor, weight: Tensor, out_features: int, gated: bool = False,
                   tokens_at_most: int = FEW_TOKENS) -> GemvConfig | FewTokensConfig | None:
    """The configuration of the kernel that serves this call — the one-token kernel's for one
    token, `gemv_tokens`'s for up to `tokens_at_most` — else None (then cuBLAS runs)."""
    tokens = _tokens_on_gpu(x, weight, x.dtype)
    if tokens == 1:
        return gemv_config(out_features, weight.shape[1], gated, _pdl(x.device.index))
    if 1 < tokens <= tokens_at_most:
        return few_tokens_config(out_features, weight.shape[1], gated)
    return None


def _run(x: Tensor, weight: Tensor, config: GemvConfig | FewTokensConfig, out_features: int,
         gated: bool = False, out_dtype: torch.dtype | None = None) -> Tensor:
    """x [..., K] through the kernel `config` is for, [..., out_features] out."""
    if isinstance(config, GemvConfig):
        out = gemv(x.reshape(-1).contiguous(), weight, config, gated=gated, out_dtype=out_dtype)
    else:
        out = gemv_tokens(x.reshape(-1, weight.shape[1]).contiguous(), weight, config, gated=gated)
    return out.view(*x.shape[:-1], out_features)


@torch.library.custom_op("flare::linear", mutates_args=())
def linear(x: Tensor, weight: Tensor) -> Tensor:
    """F.linear(x, weight) without bias; one token through the GEMV kernel, up to FEW_TOKENS
    through `gemv_tokens`."""
    config = _kernel_config(x, weight, weight.shape[0])
    if config is None:
        return F.linear(x, weight)
    return _run(x, weight, config, weight.shape[0])


@linear.register_fake
def _(x: Tensor, weight: Tensor) -> Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op("flare::linear_float32", mutates_args=())
def linear_float32(x: Tensor, weight: Tensor) -> Tensor:
    """F.linear(x.float(), weight.float()), as sigmoid MoE routers compute their logits (casting
    a 16-bit weight every call); one token through the GEMV kernel, whose products and sums are
    float32 already, writing float32."""
    config = _kernel_config(x, weight, weight.shape[0], tokens_at_most=1)
    if config is None:
        return F.linear(x.float(), weight.float())
    return _run(x, weight, config, weight.shape[0], out_dtype=torch.float32)


@linear_float32.register_fake
def _(x: Tensor, weight: Tensor) -> Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=torch.float32)


@torch.library.custom_op("flare::gated_linear", mutates_args=())
def gated_linear(x: Tensor, weight: Tensor) -> Tensor:
    """silu(gate) * up of F.linear(x, weight).chunk(2, -1); one token through the GEMV kernel, up
    to FEW_TOKENS through `gemv_tokens`."""
    half = weight.shape[0] // 2
    config = _kernel_config(x, weight, half, gated=True)
    if config is None:
        gate, up = F.linear(x, weight).chunk(2, dim=-1)
        return F.silu(gate) * up
    return _run(x, weight, config, half, gated=True)


@gated_linear.register_fake
def _(x: Tensor, weight: Tensor) -> Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0] // 2))
