"""FP8 weights kept in the core: block-scaled float8_e4m3fn linear layers.

A quantized linear layer `P` stores `P.weight` [out, in] as float8_e4m3fn and `P.weight_scale_inv`
[ceil(out / 128), ceil(in / 128)] as float32, one scale per 128 x 128 block (the last block row
and column partial when a dimension is no multiple of 128): the layout of DeepSeek's and Qwen's
published FP8 checkpoints, whose weight is

    W[i, j] = float32(P.weight[i, j]) * P.weight_scale_inv[i // 128, j // 128].

A checkpoint's own blocks may be smaller (DeepSeek V4.1 publishes 32 x 32): the sides are
BLOCK_SIDES, and the scales' grid over the weight says which (`block_of`); every path below but
cuBLAS's GEMM (128 x 128 only) takes them.

`flare export --quantize fp8` quantizes the prepared linear weights of the decoder layers (fused
QKV and gate/up included: a fused matrix is quantized as one, so its blocks always line up) and
their packed routed experts; embeddings, norms, routers and the head keep the export dtype. A
block's scale is its largest magnitude over 448 (the largest finite e4m3), as DeepSeek's
published weights have it.

Packed routed experts (those the fused experts op computes) are quantized expert by expert:
`gate_up_proj` [E, 2I, hidden] beside `gate_up_proj_scale_inv` [E, ceil(2I / 128), ceil(hidden /
128)], and `down_proj` likewise.

`Fp8BlockLinear` (flare_core.ops.fp8) calls the custom op `flare::fp8_linear` (and a fused
gate/up with SiLU, `flare::fp8_gated_linear`):

* one token on a CUDA device: `fp8_gemv`, flare_core.kernels.gemv's kernel over FP8 rows, which
  multiplies x by each block's scale in registers (float32 accumulation);
* several tokens on Hopper: the activations are quantized to e4m3 per token and 128 columns
  (`quantize_groups`, one Triton kernel) for cuBLAS's block-scaled FP8 GEMM (`torch._scaled_mm`
  with 1 x 128 scales for the activations and 128 x 128 for the weight), where it takes the shape
  (whole 128-row blocks, K a multiple of 512);
* several tokens otherwise on a CUDA device: `fp8_mm`, FP8 tiles widened to the activations'
  dtype for tensor-core dots, each 128-column block's product scaled once;
* the CPU: the weight dequantized to x's dtype, then F.linear (the reference).

On the H200 (benchmarks/fp8_linear.py, Qwen3-8B shapes) the one-token kernel takes 0.62-0.65x the
bf16 GEMV's time; cuBLAS's GEMM at 8-64 tokens takes 0.8-1.4x bf16's time on the 4,096-row
projections and 0.65-0.7x on gate/up, at 256 tokens 0.65-1.0x, at 2,048 tokens 0.65-0.73x.

Packed FP8 experts go to `flare::routed_experts` with their scales (flare_core.kernels.moe): its
Triton kernels read FP8 rows and scale each 128-column tile once; its CPU loop dequantizes each
expert in use.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from flare_core.kernels.gemv import GemvConfig, _pdl, one_token_on_gpu

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: every call dequantizes
    triton = None

BLOCK = (128, 128)
# The block sides a weight's scales may cover, largest first: 128 (DeepSeek V3 / V4, Qwen -FP8), 64,
# and 32 (DeepSeek V4.1 publishes 32 x 32 blocks). A layer's block follows from its weight's and
# scales' shapes (`block_of`).
BLOCK_SIDES = (128, 64, 32)
FP8_MAX = 448.0  # largest finite float8_e4m3fn
SCALE_SUFFIX = "_scale_inv"  # P.weight -> P.weight_scale_inv


def quantize_blocks(weight: Tensor, block: tuple[int, int] = BLOCK, powers: bool = False) -> tuple[Tensor, Tensor]:
    """(float8_e4m3fn weight, float32 scale_inv [ceil(rows / block_rows), ceil(cols / block_cols)])
    of a [rows, cols] weight: per block, scale_inv = amax / 448 (1 for an all-zero block) and the
    weight divided by it, rounded to e4m3. `powers`: scale_inv the smallest power of two at or above
    amax / 448 (DeepSeek's ue8m0 scales): a block of such a weight, or any part of one, quantizes
    back to the same values (scaled by powers of two)."""
    rows, cols = weight.shape
    block_rows, block_cols = block
    grid = (-(-rows // block_rows), -(-cols // block_cols))
    padded = weight.new_zeros(grid[0] * block_rows, grid[1] * block_cols, dtype=torch.float32)
    padded[:rows, :cols] = weight.float()
    tiles = padded.view(grid[0], block_rows, grid[1], block_cols)
    amax = tiles.abs().amax(dim=(1, 3))
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    if powers:
        scale_inv = torch.exp2(torch.ceil(torch.log2(scale_inv)))
    scaled = (tiles / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view_as(padded)[:rows, :cols]
    return scaled.to(torch.float8_e4m3fn).contiguous(), scale_inv.contiguous()


def block_of(weight: Tensor, scale_inv: Tensor) -> tuple[int, int]:
    """The (rows, cols) block whose grid over `weight` [..., N, K] is `scale_inv`'s [..., ceil(N /
    rows), ceil(K / cols)]: on each side the largest of BLOCK_SIDES that gives it (sides that give
    the same grid quantize the weight the same way). ValueError where none does."""
    def side(size: int, count: int) -> int:
        for candidate in BLOCK_SIDES:
            if -(-size // candidate) == count:
                return candidate
        raise ValueError(f"FP8 scales {tuple(scale_inv.shape)} cover no block of {BLOCK_SIDES} over a weight of "
                         f"{tuple(weight.shape)}")

    return side(weight.shape[-2], scale_inv.shape[-2]), side(weight.shape[-1], scale_inv.shape[-1])


def dequantize_blocks(weight: Tensor, scale_inv: Tensor, block: tuple[int, int] | None = None,
                      dtype: torch.dtype = torch.float32) -> Tensor:
    """The value of a block-quantized [rows, cols] weight as `dtype` (each product computed in
    float32 and rounded once); `block` as its scales' grid says (`block_of`) unless given. Memory:
    one `dtype` copy of the weight (scales are expanded over rows only and broadcast over columns
    through a view)."""
    rows, cols = weight.shape
    block_rows, block_cols = block or block_of(weight, scale_inv)
    out = weight.to(dtype, copy=True)
    scale = scale_inv.to(torch.float32).repeat_interleave(block_rows, dim=0)[:rows]
    full, partial = divmod(cols, block_cols)
    if full:
        out[:, :full * block_cols].unflatten(1, (full, block_cols)).mul_(scale[:, :full, None])
    if partial:
        out[:, full * block_cols:].mul_(scale[:, full:])
    return out


if triton is not None:
    @triton.jit(do_not_specialize=["N", "GROUP_ROWS"])  # as flare_core.kernels.gemv's: an N of 1 stays a runtime value
    def _fp8_gemv_kernel(x_ptr, w_ptr, scale_ptr, out_ptr, N, K, SCALE_COLUMNS, GROUP_ROWS, ROWS: tl.constexpr,
                         COLUMNS: tl.constexpr, GATED: tl.constexpr, PDL: tl.constexpr,
                         BLOCK_ROWS: tl.constexpr = 128, BLOCK_COLS: tl.constexpr = 128):
        # flare_core.kernels.gemv's kernel over FP8 rows: program p reads weight rows [p * ROWS, (p + 1)
        # * ROWS) (gated: and the up rows N below them), COLUMNS at a time. Its rows lie in one
        # block of BLOCK_ROWS rows (ROWS divides it and, gated, N), so x is multiplied by the block's
        # scales rather than each weight: one scale per iteration when COLUMNS is BLOCK_COLS, else
        # each column's (a load that the L1 cache serves). A grouped weight (GROUP_ROWS rows per group, ROWS
        # dividing it) multiplies group g's rows by x's g-th K features; else GROUP_ROWS is N.
        if PDL:  # the kernel after this one may start now: it waits for our output itself
            tl.extra.cuda.gdc_launch_dependents()
        first_row = tl.program_id(0) * ROWS
        x_ptr += (first_row // GROUP_ROWS).to(tl.int64) * K
        rows = first_row + tl.arange(0, ROWS)
        row_mask = rows[:, None] < N
        columns = tl.arange(0, COLUMNS)
        offsets = rows[:, None].to(tl.int64) * K + columns[None, :]
        up_shift = N.to(tl.int64) * K
        scales = scale_ptr + (first_row // BLOCK_ROWS) * SCALE_COLUMNS
        up_scales = scale_ptr + ((first_row + N) // BLOCK_ROWS) * SCALE_COLUMNS
        # The weights do not depend on the kernel before: the first columns load while it ends.
        w = tl.load(w_ptr + offsets, mask=row_mask, other=0.0)
        up = tl.load(w_ptr + offsets + up_shift, mask=row_mask, other=0.0) if GATED else w
        if PDL:  # x is the previous kernel's output
            tl.extra.cuda.gdc_wait()
        x = tl.load(x_ptr + columns).to(tl.float32)
        if COLUMNS == BLOCK_COLS:
            x_up = x * tl.load(up_scales) if GATED else x
            x = x * tl.load(scales)
        else:
            x_up = x * tl.load(up_scales + columns // BLOCK_COLS) if GATED else x
            x = x * tl.load(scales + columns // BLOCK_COLS)
        acc = w.to(tl.float32) * x[None, :]
        up_acc = up.to(tl.float32) * x_up[None, :]
        for start in range(COLUMNS, K, COLUMNS):
            x = tl.load(x_ptr + start + columns).to(tl.float32)
            if COLUMNS == BLOCK_COLS:
                x_up = x * tl.load(up_scales + start // BLOCK_COLS) if GATED else x
                x = x * tl.load(scales + start // BLOCK_COLS)
            else:
                x_up = x * tl.load(up_scales + (start + columns) // BLOCK_COLS) if GATED else x
                x = x * tl.load(scales + (start + columns) // BLOCK_COLS)
            w = tl.load(w_ptr + offsets + start, mask=row_mask, other=0.0)
            acc += w.to(tl.float32) * x[None, :]
            if GATED:
                up = tl.load(w_ptr + offsets + up_shift + start, mask=row_mask, other=0.0)
                up_acc += up.to(tl.float32) * x_up[None, :]
        y = tl.sum(acc, axis=1)
        if GATED:  # silu(gate) * up
            y = y * tl.sigmoid(y) * tl.sum(up_acc, axis=1)
        tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=rows < N)

    @triton.jit
    def _fp8_mm_kernel(x_ptr, w_ptr, scale_ptr, out_ptr, M, N, K, SCALE_COLUMNS, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_ROWS: tl.constexpr = 128, BLOCK_COLS: tl.constexpr = 128):
        # out[M, N] = x[M, K] @ W^T for a few tokens: the FP8 weight tile of each BLOCK_COLS-column
        # block is widened to x's dtype in registers for a tensor-core dot with the 16-bit
        # activations, and the block's product is scaled once (BLOCK_N divides BLOCK_ROWS: one
        # scale per tile).
        m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        first_n = tl.program_id(0) * BLOCK_N
        n = first_n + tl.arange(0, BLOCK_N)
        k = tl.arange(0, BLOCK_COLS)
        x_rows = x_ptr + m[:, None].to(tl.int64) * K + k[None, :]
        w_rows = w_ptr + n[:, None].to(tl.int64) * K + k[None, :]
        scales = scale_ptr + (first_n // BLOCK_ROWS) * SCALE_COLUMNS
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for block in range(0, tl.cdiv(K, BLOCK_COLS)):
            k_mask = k[None, :] < K - block * BLOCK_COLS
            a = tl.load(x_rows + block * BLOCK_COLS, mask=(m[:, None] < M) & k_mask, other=0.0)
            w = tl.load(w_rows + block * BLOCK_COLS, mask=(n[:, None] < N) & k_mask, other=0.0)
            acc += tl.dot(a, tl.trans(w.to(a.dtype))) * tl.load(scales + block)
        tl.store(out_ptr + m[:, None].to(tl.int64) * N + n[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=(m[:, None] < M) & (n[None, :] < N))

    @triton.jit
    def _quantize_groups_kernel(x_ptr, q_ptr, scale_ptr, M, K, ROWS_OUT, BLOCK_M: tl.constexpr):
        # Program (i, g) quantizes columns [128 g, 128 (g + 1)) of rows [i BLOCK_M, (i + 1) BLOCK_M);
        # rows at or past M (padding) come out as zeros with scale 1. Scales are stored group-major:
        # scale[g, row], the "outer-dimension-major" layout cuBLAS reads.
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        columns = tl.program_id(1) * 128 + tl.arange(0, 128)
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * K + columns[None, :], mask=rows[:, None] < M,
                    other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), axis=1)
        scale = tl.where(amax > 0, amax / 448.0, 1.0)
        q = tl.math.div_rn(x, scale[:, None])  # correctly rounded, as torch divides
        tl.store(q_ptr + rows[:, None].to(tl.int64) * K + columns[None, :], q.to(q_ptr.dtype.element_ty),
                 mask=rows[:, None] < ROWS_OUT)
        tl.store(scale_ptr + tl.program_id(1) * ROWS_OUT + rows, scale, mask=rows < ROWS_OUT)


def fp8_gemv_config(out_features: int, in_features: int, gated: bool = False, pdl: bool = False) -> GemvConfig | None:
    """The FP8 GEMV's launch configuration for a [out_features, in_features] weight (gated: twice
    as many rows), or None when the kernel does not take the shape. Rows per program divide every
    block side (32, 64, 128; and, gated, out_features) so that a program's rows share their scales.

    Eight rows per program, 512 columns per iteration for matrices of more than 4,096 rows (1,024
    else): on the H200 the fastest of 88 configurations for each matrix a Qwen3-8B decode step
    reads (qkv, o, gate/up with SiLU, down; benchmarks/fp8_linear.py --tokens 1,
    benchmarks/results/h200-fp8-linear.json)."""
    rows = 1 if out_features < 1024 else 8
    if gated and out_features % rows:
        return None
    preferred = 512 if (2 * out_features if gated else out_features) > 4096 else 1024
    for columns in sorted({preferred, 1024, 512, 256, 128}, key=lambda c: (c != preferred, -c)):
        if in_features % columns == 0:
            return GemvConfig(rows=rows, columns=columns, warps=4, stages=1, pdl=pdl)
    return None


def _fp8_gemv_path(x: Tensor, weight: Tensor, out_features: int, gated: bool = False) -> GemvConfig | None:
    """The FP8 GEMV's configuration when this call is one token it serves, else None."""
    if not one_token_on_gpu(x, weight, torch.float8_e4m3fn):
        return None
    return fp8_gemv_config(out_features, weight.shape[1], gated, _pdl(x.device.index))


def fp8_gemv(x: Tensor, weight: Tensor, scale_inv: Tensor, config: GemvConfig, gated: bool = False,
             groups: int = 1) -> Tensor:
    """x [K] @ W^T -> [N] in x's dtype for a block-quantized FP8 weight (weight [N, K], scale_inv
    [ceil(N / 128), K / 128]; gated: [2N, K], and the result is silu(gate) * up, [N]). `groups`:
    a block-diagonal grouped weight, x [groups * K], group g's N / groups rows times x's g-th K
    features (N / groups a multiple of the config's rows)."""
    out_features = weight.shape[0] // 2 if gated else weight.shape[0]
    out = x.new_empty(out_features)
    block_rows, block_cols = block_of(weight, scale_inv)
    _fp8_gemv_kernel[(triton.cdiv(out_features, config.rows),)](
        x, weight, scale_inv, out, out_features, weight.shape[1], scale_inv.shape[1], out_features // groups,
        ROWS=config.rows, COLUMNS=config.columns, GATED=gated, PDL=config.pdl, BLOCK_ROWS=block_rows,
        BLOCK_COLS=block_cols, num_warps=config.warps, num_stages=config.stages, launch_pdl=config.pdl)
    return out


def fp8_mm(x: Tensor, weight: Tensor, scale_inv: Tensor, block_n: int = 32, warps: int = 4, stages: int = 4) -> Tensor:
    """x [M, K] @ W^T -> [M, N] in x's dtype for a block-quantized FP8 weight whose shape cuBLAS's
    block-scaled GEMM does not take (up to 64 tokens form one tile, so each weight tile is read
    once). On the H200 it is no faster than cuBLAS where both serve (benchmarks/fp8_linear.py)."""
    rows, features = x.shape
    out_features = weight.shape[0]
    out = x.new_empty(rows, out_features)
    block_m = min(64, max(16, triton.next_power_of_2(rows)))
    block_rows, block_cols = block_of(weight, scale_inv)
    block_n = min(block_n, block_rows)
    _fp8_mm_kernel[(triton.cdiv(out_features, block_n), triton.cdiv(rows, block_m))](
        x, weight, scale_inv, out, rows, out_features, features, scale_inv.shape[1], BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols, num_warps=warps, num_stages=stages)
    return out


def quantize_groups(x: Tensor, rows_out: int) -> tuple[Tensor, Tensor]:
    """(float8_e4m3fn [rows_out, K], float32 scales [rows_out, K / 128] with strides (1, rows_out))
    of activations x [M, K] (M <= rows_out; the rows past M are zeros): one scale per token and
    128 columns, that group's largest magnitude over 448."""
    rows, features = x.shape
    q = torch.empty(rows_out, features, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(features // 128, rows_out, dtype=torch.float32, device=x.device)
    block_m = 16
    _quantize_groups_kernel[(triton.cdiv(rows_out, block_m), features // 128)](
        x, q, scales, rows, features, rows_out, BLOCK_M=block_m, num_warps=4)
    return q, scales.t()


@functools.cache
def _block_scaled_gemm(device_index: int) -> bool:
    """cuBLAS's block-scaled FP8 GEMM (1 x 128 by 128 x 128 scales) is a Hopper (SM 9.0) kernel."""
    return torch.cuda.get_device_capability(device_index) == (9, 0)


def _triton_path(x: Tensor, weight: Tensor) -> bool:
    """Whether `x` [M, K] @ W^T of an FP8 weight [N, K] runs on this device's Triton kernels."""
    return (triton is not None and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype == torch.float8_e4m3fn and weight.is_contiguous() and x.is_contiguous())


def _gemm_path(x: Tensor, weight: Tensor, scale_inv: Tensor) -> bool:
    """Whether `x` [M, K] @ W^T runs as cuBLAS's block-scaled FP8 GEMM, which takes 128 x 128 blocks
    and wants the scales' leading dimensions 16-byte aligned: K / 128 a multiple of 4 (the token
    count is padded), and whole 128-row blocks."""
    out_features, features = weight.shape
    return (_triton_path(x, weight) and features % 512 == 0 and out_features % 128 == 0
            and block_of(weight, scale_inv) == BLOCK and _block_scaled_gemm(x.device.index))


def block_scaled_mm(x: Tensor, weight: Tensor, scale_inv: Tensor) -> Tensor:
    """x [M, K] @ dequantized(weight [N, K], scale_inv)^T -> [M, N] in x's dtype, through FP8
    activations (quantize_groups) and cuBLAS's block-scaled FP8 GEMM."""
    rows = x.shape[0]
    q, scales = quantize_groups(x, -(-rows // 4) * 4)
    out = torch._scaled_mm(q, weight.t(), scales, scale_inv.t(), out_dtype=x.dtype)
    return out[:rows]


@torch.library.custom_op("flare::fp8_linear", mutates_args=())
def fp8_linear(x: Tensor, weight: Tensor, scale_inv: Tensor) -> Tensor:
    """F.linear(x, W) of a block-quantized FP8 weight W (weight [N, K] float8_e4m3fn, scale_inv
    [ceil(N / rows), ceil(K / cols)] for blocks of BLOCK_SIDES, `block_of`), in x's dtype: see the
    module docstring for the paths."""
    out_features, features = weight.shape
    config = _fp8_gemv_path(x, weight, out_features)
    if config is not None:
        return fp8_gemv(x.reshape(-1).contiguous(), weight, scale_inv, config).view(*x.shape[:-1], out_features)
    flat = x.reshape(-1, features)
    if flat.shape[0] and _gemm_path(flat, weight, scale_inv):
        return block_scaled_mm(flat, weight, scale_inv).view(*x.shape[:-1], out_features)
    if flat.shape[0] and _triton_path(flat, weight):
        return fp8_mm(flat, weight, scale_inv).view(*x.shape[:-1], out_features)
    return F.linear(x, dequantize_blocks(weight, scale_inv, dtype=x.dtype))


@fp8_linear.register_fake
def _(x: Tensor, weight: Tensor, scale_inv: Tensor) -> Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op("flare::fp8_grouped_linear", mutates_args=())
def fp8_grouped_linear(x: Tensor, weight: Tensor, scale_inv: Tensor) -> Tensor:
    """A block-diagonal grouped linear layer over a block-quantized FP8 weight: x [..., G, K],
    weight [G * R, K] (group g's R rows applied to x[..., g, :]) -> [..., G, R] in x's dtype. One
    token on a GPU: every group in one FP8 GEMV launch; else group by group through `fp8_linear`
    (the block grid must split at group boundaries: R a multiple or a divisor of the block's rows)."""
    groups = x.shape[-2]
    rows = weight.shape[0] // groups
    config = _fp8_gemv_path(x[..., 0, :], weight, weight.shape[0])  # one token: one group's features
    if config is not None and rows % config.rows == 0:
        return fp8_gemv(x.reshape(-1).contiguous(), weight, scale_inv, config, groups=groups).view(
            *x.shape[:-1], rows)
    side = block_of(weight, scale_inv)[0]
    outputs = [fp8_linear(x[..., g, :].contiguous(), weight[g * rows:(g + 1) * rows],
                          scale_inv[g * rows // side:((g + 1) * rows - 1) // side + 1]) for g in range(groups)]
    return torch.stack(outputs, dim=-2)


@fp8_grouped_linear.register_fake
def _(x: Tensor, weight: Tensor, scale_inv: Tensor) -> Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0] // x.shape[-2]))


@torch.library.custom_op("flare::fp8_gated_linear", mutates_args=())
def fp8_gated_linear(x: Tensor, weight: Tensor, scale_inv: Tensor) -> Tensor:
    """silu(gate) * up of `fp8_linear(x, weight, scale_inv).chunk(2, -1)`; one token through the
    gated GEMV kernel."""
    half = weight.shape[0] // 2
    config = _fp8_gemv_path(x, weight, half, gated=True)
    if config is None:
        gate, up = fp8_linear(x, weight, scale_inv).chunk(2, dim=-1)
        return F.silu(gate) * up
    return fp8_gemv(x.reshape(-1).contiguous(), weight, scale_inv, config, gated=True).view(*x.shape[:-1], half)


@fp8_gated_linear.register_fake
def _(x: Tensor, weight: Tensor, scale_inv: Tensor) -> Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0] // 2))


def quantize_experts(packed: Tensor, block: tuple[int, int] = BLOCK, powers: bool = False) -> tuple[Tensor, Tensor]:
    """`quantize_blocks` of each expert of a packed [E, rows, cols] tensor: (float8_e4m3fn
    [E, rows, cols], float32 scale_inv [E, ceil(rows / 128), ceil(cols / 128)])."""
    weights, scales = zip(*(quantize_blocks(expert, block, powers) for expert in packed))
    return torch.stack(weights), torch.stack(scales)
