"""FP8 weights kept in the core: block-scaled float8_e4m3fn linear layers.

A quantized linear layer `P` stores `P.weight` [out, in] as float8_e4m3fn and `P.weight_scale_inv`
[ceil(out / 128), ceil(in / 128)] as float32, one scale per 128 x 128 block (the last block row
and column partial when a dimension is no multiple of 128): the layout of DeepSeek's and Qwen's
published FP8 checkpoints, whose weight is

    W[i, j] = float32(P.weight[i, j]) * P.weight_scale_inv[i // 128, j // 128].

`flare export --quantize fp8` quantizes the prepared linear weights of the decoder layers (fused
QKV and gate/up included: a fused matrix is quantized as one, so its blocks always line up) and
their packed routed experts; embeddings, norms, routers and the head keep the export dtype. A block's scale is
its largest magnitude over 448 (the largest finite e4m3), as DeepSeek's published weights have it.

Packed routed experts (those the fused experts op computes) are quantized expert by expert:
`gate_up_proj` [E, 2I, hidden] beside `gate_up_proj_scale_inv` [E, ceil(2I / 128), ceil(hidden /
128)], and `down_proj` likewise.

`Fp8BlockLinear` calls the custom op `flare::fp8_linear`:

* one token on a CUDA device: the GEMV kernel (flare_core.ops.gemv) reads the FP8 rows and
  multiplies x by each 128-column block's scale in registers, float32 accumulation;
* several tokens on a CUDA device: the activations are quantized to FP8 per token and 128
  columns (`quantize_groups`, one Triton kernel) and multiplied by cuBLAS's block-scaled FP8 GEMM
  (`torch._scaled_mm`, 1 x 128 scales for the activations, 128 x 128 for the weight; Hopper);
* otherwise (the CPU, shapes that GEMM does not take): the weight dequantized to x's dtype, then
  F.linear. This is the reference the others are tested against.

Packed FP8 experts go to `flare::routed_experts` with their scales (flare_core.ops.moe): its
Triton kernels read FP8 rows and scale each 128-column tile once; its CPU loop dequantizes each
expert in use.
"""

from __future__ import annotations

from collections.abc import Iterable

import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flare_core.ops.gemv import _gemv_path, gemv

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: every call dequantizes
    triton = None

BLOCK = (128, 128)
FP8_MAX = 448.0  # largest finite float8_e4m3fn
SCALE_SUFFIX = "_scale_inv"  # P.weight -> P.weight_scale_inv


def quantize_blocks(weight: Tensor, block: tuple[int, int] = BLOCK) -> tuple[Tensor, Tensor]:
    """(float8_e4m3fn weight, float32 scale_inv [ceil(rows / block_rows), ceil(cols / block_cols)])
    of a [rows, cols] weight: per block, scale_inv = amax / 448 (1 for an all-zero block) and the
    weight divided by it, rounded to e4m3."""
    rows, cols = weight.shape
    block_rows, block_cols = block
    grid = (-(-rows // block_rows), -(-cols // block_cols))
    padded = weight.new_zeros(grid[0] * block_rows, grid[1] * block_cols, dtype=torch.float32)
    padded[:rows, :cols] = weight.float()
    tiles = padded.view(grid[0], block_rows, grid[1], block_cols)
    amax = tiles.abs().amax(dim=(1, 3))
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    scaled = (tiles / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view_as(padded)[:rows, :cols]
    return scaled.to(torch.float8_e4m3fn).contiguous(), scale_inv.contiguous()


def dequantize_blocks(weight: Tensor, scale_inv: Tensor, block: tuple[int, int] = BLOCK,
                      dtype: torch.dtype = torch.float32) -> Tensor:
    """The value of a block-quantized [rows, cols] weight as `dtype` (each product computed in
    float32 and rounded once). Memory: one `dtype` copy of the weight (scales are expanded over
    rows only and broadcast over columns through a view)."""
    rows, cols = weight.shape
    block_rows, block_cols = block
    out = weight.to(dtype, copy=True)
    scale = scale_inv.to(torch.float32).repeat_interleave(block_rows, dim=0)[:rows]
    full, partial = divmod(cols, block_cols)
    if full:
        out[:, :full * block_cols].unflatten(1, (full, block_cols)).mul_(scale[:, :full, None])
    if partial:
        out[:, full * block_cols:].mul_(scale[:, full:])
    return out


if triton is not None:
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
        q = x / scale[:, None]
        tl.store(q_ptr + rows[:, None].to(tl.int64) * K + columns[None, :], q.to(q_ptr.dtype.element_ty),
                 mask=rows[:, None] < ROWS_OUT)
        tl.store(scale_ptr + tl.program_id(1) * ROWS_OUT + rows, scale, mask=rows < ROWS_OUT)


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


def _gemm_path(x: Tensor, weight: Tensor) -> bool:
    """Whether `x` [M, K] @ `weight`^T runs as a block-scaled FP8 GEMM. cuBLAS wants the scales'
    leading dimensions 16-byte aligned: K / 128 a multiple of 4 (the token count is padded)."""
    out_features, features = weight.shape
    return (triton is not None and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
            and weight.is_contiguous() and x.is_contiguous() and features % 512 == 0 and out_features % 128 == 0
            and _block_scaled_gemm(x.device.index))


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
    [ceil(N / 128), ceil(K / 128)]), in x's dtype: see the module docstring for the paths."""
    out_features, features = weight.shape
    config = _gemv_path(x, weight, out_features, scaled=True)
    if config is not None:
        return gemv(x.reshape(-1).contiguous(), weight, config, scale=scale_inv).view(*x.shape[:-1], out_features)
    flat = x.reshape(-1, features)
    if flat.shape[0] and _gemm_path(flat, weight):
        return block_scaled_mm(flat.contiguous(), weight, scale_inv).view(*x.shape[:-1], out_features)
    return F.linear(x, dequantize_blocks(weight, scale_inv, dtype=x.dtype))


@fp8_linear.register_fake
def _(x: Tensor, weight: Tensor, scale_inv: Tensor) -> Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op("flare::fp8_gated_linear", mutates_args=())
def fp8_gated_linear(x: Tensor, weight: Tensor, scale_inv: Tensor) -> Tensor:
    """silu(gate) * up of `fp8_linear(x, weight, scale_inv).chunk(2, -1)`; one token through the
    gated GEMV kernel."""
    half = weight.shape[0] // 2
    config = _gemv_path(x, weight, half, gated=True, scaled=True)
    if config is None:
        gate, up = fp8_linear(x, weight, scale_inv).chunk(2, dim=-1)
        return F.silu(gate) * up
    return gemv(x.reshape(-1).contiguous(), weight, config, gated=True, scale=scale_inv).view(*x.shape[:-1], half)


@fp8_gated_linear.register_fake
def _(x: Tensor, weight: Tensor, scale_inv: Tensor) -> Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0] // 2))


class Fp8BlockLinear(nn.Module):
    """A linear layer over a block-quantized FP8 weight (the scales a persistent buffer: they are
    no parameters), computed by `flare::fp8_linear`."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn),
                                   requires_grad=False)
        grid = (-(-out_features // BLOCK[0]), -(-in_features // BLOCK[1]))
        self.register_buffer("weight_scale_inv", torch.empty(grid, dtype=torch.float32))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        out = torch.ops.flare.fp8_linear(x, self.weight, self.weight_scale_inv)
        return out if self.bias is None else out + self.bias


def quantize_experts(packed: Tensor, block: tuple[int, int] = BLOCK) -> tuple[Tensor, Tensor]:
    """`quantize_blocks` of each expert of a packed [E, rows, cols] tensor: (float8_e4m3fn
    [E, rows, cols], float32 scale_inv [E, ceil(rows / 128), ceil(cols / 128)])."""
    weights, scales = zip(*(quantize_blocks(expert, block) for expert in packed))
    return torch.stack(weights), torch.stack(scales)


def quantizable_experts(model: nn.Module) -> list[str]:
    """Module paths of the packed routed experts `--quantize fp8` quantizes: those the fused
    experts op computes (flare_core.ops.moe; SiLU-gated, no biases), when the model uses it."""
    if not getattr(model, "fused_experts", False):
        return []
    layers = model.model.layers
    return [f"model.layers.{path}" for path, module in layers.named_modules()
            if isinstance(getattr(module, "gate_up_proj", None), nn.Parameter)
            and getattr(module, "gate_up_proj").dim() == 3]


def use_fp8_experts(model: nn.Module, names: Iterable[str]) -> nn.Module:
    """Make the packed expert tensors `names` (`<experts path>.gate_up_proj` / `.down_proj`) FP8:
    the parameter float8_e4m3fn (on the meta device, to be filled by flare_core.ops.loading)
    beside a `<name>_scale_inv` buffer of per-expert block scales; in place, returns `model`."""
    for name in names:
        path, _, leaf = name.rpartition(".")
        experts = model.get_submodule(path)
        count, rows, cols = getattr(experts, leaf).shape
        with torch.device("meta"):
            setattr(experts, leaf, nn.Parameter(torch.empty(count, rows, cols, dtype=torch.float8_e4m3fn),
                                                requires_grad=False))
            experts.register_buffer(leaf + SCALE_SUFFIX, torch.empty(
                count, -(-rows // BLOCK[0]), -(-cols // BLOCK[1]), dtype=torch.float32))
    return model


def quantizable_linears(model: nn.Module) -> list[str]:
    """Module paths of the linear layers `--quantize fp8` quantizes: every nn.Linear inside the
    decoder layers (`model.model.layers`). Routers, packed experts, embeddings, norms and the
    head are no nn.Linear there (packed experts: `quantizable_experts`)."""
    layers = model.model.layers
    return [f"model.layers.{path}" for path, module in layers.named_modules() if type(module) is nn.Linear]


def use_fp8_blocks(model: nn.Module, paths: Iterable[str]) -> nn.Module:
    """Replace the nn.Linear modules at `paths` by `Fp8BlockLinear`s of the same shape (on the
    meta device, to be filled by flare_core.ops.loading), in place; returns `model`."""
    for path in paths:
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        linear = getattr(parent, name)
        if type(linear) is not nn.Linear:
            raise ValueError(f"{path}: FP8 weights replace nn.Linear layers, this is a {type(linear).__name__}")
        with torch.device("meta"):
            setattr(parent, name, Fp8BlockLinear(linear.in_features, linear.out_features, linear.bias is not None,
                                                 linear.weight.dtype))
    return model


def quantized_paths(tensor_names: Iterable[str]) -> list[str]:
    """Module paths of the FP8 linear layers among a core's tensor names (those with a scale)."""
    suffix = ".weight" + SCALE_SUFFIX
    return sorted(name[:-len(suffix)] for name in tensor_names if name.endswith(suffix))


def quantized_experts(tensor_names: Iterable[str]) -> list[str]:
    """The FP8 packed expert tensors (`<experts path>.gate_up_proj` / `.down_proj`) among a
    core's tensor names."""
    suffixes = tuple(f".{leaf}{SCALE_SUFFIX}" for leaf in ("gate_up_proj", "down_proj"))
    return sorted(name[:-len(SCALE_SUFFIX)] for name in tensor_names if name.endswith(suffixes))
