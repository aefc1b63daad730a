"""FP8 weights in a model built for serving: `Fp8BlockLinear` layers over block-scaled
float8_e4m3fn weights, FP8 packed experts, and which of a model's layers `--quantize fp8`
quantizes. The layout and the kernels: flare_core.kernels.fp8."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn

from flare_core.kernels.fp8 import BLOCK, SCALE_SUFFIX, dequantize_blocks


class Fp8BlockLinear(nn.Module):
    """A linear layer over a block-quantized FP8 weight (the scales a persistent buffer: they are
    no parameters), computed by `flare::fp8_linear`."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 block: tuple[int, int] = BLOCK):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn),
                                   requires_grad=False)
        grid = (-(-out_features // block[0]), -(-in_features // block[1]))
        self.register_buffer("weight_scale_inv", torch.empty(grid, dtype=torch.float32))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        out = torch.ops.flare.fp8_linear(x, self.weight, self.weight_scale_inv)
        return out if self.bias is None else out + self.bias


def linear_groups(module: nn.Module) -> int | None:
    """The group count of a block-diagonal grouped linear layer: an nn.Linear with an integer
    `n_groups` whose [out_features, in_features] weight stacks one block of out_features / n_groups
    rows per group, group g applied to input slice g ([..., n_groups, in_features] -> [..., n_groups,
    out_features / n_groups]: Transformers' `DeepseekV4GroupedLinear`); None for another module."""
    groups = getattr(module, "n_groups", None)
    return groups if isinstance(module, nn.Linear) and isinstance(groups, int) and module.bias is None else None


class Fp8GroupedLinear(nn.Module):
    """A grouped linear layer (`linear_groups`) over a block-quantized FP8 weight, computed by
    `flare::fp8_grouped_linear` (one token: one launch for every group) where the block grid splits
    at group boundaries (rows per group a multiple or a divisor of the block's rows: every slice
    has its own scale rows); otherwise the weight is dequantized in each call."""

    def __init__(self, in_features: int, out_features: int, n_groups: int, block: tuple[int, int] = BLOCK):
        super().__init__()
        self.in_features, self.out_features, self.n_groups, self.block = in_features, out_features, n_groups, block
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn),
                                   requires_grad=False)
        grid = (-(-out_features // block[0]), -(-in_features // block[1]))
        self.register_buffer("weight_scale_inv", torch.empty(grid, dtype=torch.float32))

    def forward(self, x: Tensor) -> Tensor:
        rows = self.out_features // self.n_groups
        if rows % self.block[0] == 0 or self.block[0] % rows == 0:
            return torch.ops.flare.fp8_grouped_linear(x, self.weight, self.weight_scale_inv)
        weight = dequantize_blocks(self.weight, self.weight_scale_inv, dtype=x.dtype)
        return torch.einsum("...gi,goi->...go", x, weight.view(self.n_groups, rows, self.in_features))


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
    decoder layers (`model.model.layers`), grouped ones (`linear_groups`) included. Routers, packed
    experts, embeddings, norms and the head are no nn.Linear there (packed experts:
    `quantizable_experts`); nor is a subclass computing otherwise (DeepSeek V4.1's float32 pooling
    projections)."""
    layers = model.model.layers
    return [f"model.layers.{path}" for path, module in layers.named_modules()
            if type(module) is nn.Linear or linear_groups(module) is not None]


def use_fp8_blocks(model: nn.Module, paths: Iterable[str], block: tuple[int, int] = BLOCK) -> nn.Module:
    """Replace the nn.Linear modules at `paths` by `Fp8BlockLinear`s (grouped ones by
    `Fp8GroupedLinear`s) of the same shape, their scales over `block` blocks (on the meta device,
    to be filled by flare_core.ops.loading), in place; returns `model`."""
    for path in paths:
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        linear = getattr(parent, name)
        groups = linear_groups(linear)
        if type(linear) is not nn.Linear and groups is None:
            raise ValueError(f"{path}: FP8 weights replace nn.Linear layers, this is a {type(linear).__name__}")
        with torch.device("meta"):
            setattr(parent, name, Fp8BlockLinear(linear.in_features, linear.out_features, linear.bias is not None,
                                                 linear.weight.dtype, block) if groups is None else
                    Fp8GroupedLinear(linear.in_features, linear.out_features, groups, block))
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
