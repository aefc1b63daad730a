"""FP8 weights kept in the core: block-scaled float8_e4m3fn linear layers.

A quantized linear layer `P` stores `P.weight` [out, in] as float8_e4m3fn and `P.weight_scale_inv`
[ceil(out / 128), ceil(in / 128)] as float32, one scale per 128 x 128 block (the last block row
and column partial when a dimension is no multiple of 128): the layout of DeepSeek's and Qwen's
published FP8 checkpoints, whose weight is

    W[i, j] = float32(P.weight[i, j]) * P.weight_scale_inv[i // 128, j // 128].

`flare export --quantize fp8` quantizes the prepared linear weights of the decoder layers (fused
QKV and gate/up included: a fused matrix is quantized as one, so its blocks always line up);
embeddings, norms, routers, packed experts and the head keep the export dtype. A block's scale is
its largest magnitude over 448 (the largest finite e4m3), as DeepSeek's published weights have it.

`Fp8BlockLinear` is the CPU reference: it dequantizes its weight to the activation dtype in each
call. The Hopper FP8 GEMM / GEMV path is not built; cores with FP8 weights load on the CPU only.
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
    """The float32 value of a block-quantized weight."""
    rows, cols = weight.shape
    scales = scale_inv.repeat_interleave(block[0], dim=0)[:rows].repeat_interleave(block[1], dim=1)[:, :cols]
    return weight.float() * scales


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


def quantizable_linears(model: nn.Module) -> list[str]:
    """Module paths of the linear layers `--quantize fp8` quantizes: every nn.Linear inside the
    decoder layers (`model.model.layers`). Routers, packed experts, embeddings, norms and the
    head are no nn.Linear there and keep their dtype."""
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
