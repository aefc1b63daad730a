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

`Fp8BlockLinear` and `fp8_reference_experts` are the CPU reference: they dequantize a weight (an
expert in use) to the activation dtype in each call. The Hopper FP8 GEMM / GEMV path is not
built; cores with FP8 weights load on the CPU only.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

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


def dequantize_blocks(weight: Tensor, scale_inv: Tensor, block: tuple[int, int] = BLOCK) -> Tensor:
    """The float32 value of a block-quantized [rows, cols] weight. Memory: one float32 copy of the
    weight (scales are expanded over rows only and broadcast over columns through a view)."""
    rows, cols = weight.shape
    block_rows, block_cols = block
    out = weight.to(torch.float32, copy=True)
    scale = scale_inv.to(torch.float32).repeat_interleave(block_rows, dim=0)[:rows]
    full, partial = divmod(cols, block_cols)
    if full:
        out[:, :full * block_cols].unflatten(1, (full, block_cols)).mul_(scale[:, :full, None])
    if partial:
        out[:, full * block_cols:].mul_(scale[:, full:])
    return out


class Fp8BlockLinear(nn.Module):
    """A linear layer over a block-quantized FP8 weight (the scales a persistent buffer: they are
    no parameters), dequantized to the input's dtype in every call."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn),
                                   requires_grad=False)
        grid = (-(-out_features // BLOCK[0]), -(-in_features // BLOCK[1]))
        self.register_buffer("weight_scale_inv", torch.empty(grid, dtype=torch.float32))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, dequantize_blocks(self.weight, self.weight_scale_inv).to(x.dtype), self.bias)


def quantize_experts(packed: Tensor, block: tuple[int, int] = BLOCK) -> tuple[Tensor, Tensor]:
    """`quantize_blocks` of each expert of a packed [E, rows, cols] tensor: (float8_e4m3fn
    [E, rows, cols], float32 scale_inv [E, ceil(rows / 128), ceil(cols / 128)])."""
    weights, scales = zip(*(quantize_blocks(expert, block) for expert in packed))
    return torch.stack(weights), torch.stack(scales)


def fp8_reference_experts(experts: nn.Module, x: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
    """What `flare::routed_experts` computes, summed over each token's experts, for packed FP8
    experts: a loop over the experts in use, each dequantized to x's dtype when used (the CPU
    reference; no GPU kernel reads FP8 experts yet)."""
    def weight(name: str, expert: int) -> Tensor:
        scale = getattr(experts, name + SCALE_SUFFIX, None)  # one of the two may be kept unquantized
        stored = getattr(experts, name)[expert]
        return stored if scale is None else dequantize_blocks(stored, scale[expert]).to(x.dtype)

    out = torch.zeros((*top_k_index.shape, x.shape[1]), dtype=torch.float32, device=x.device)
    for expert in top_k_index.unique().tolist():
        token, slot = (top_k_index == expert).nonzero(as_tuple=True)
        gate_up, down = weight("gate_up_proj", expert), weight("down_proj", expert)
        gate, up = F.linear(x[token], gate_up).chunk(2, dim=-1)
        out[token, slot] = F.linear(F.silu(gate) * up, down).float() * top_k_weights[token, slot, None].float()
    return out.sum(dim=1).to(x.dtype)


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
