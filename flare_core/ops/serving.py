"""A recipe's model built for serving: the recipe builds it, the serving options shape its modules
in the same call, and nothing changes it afterwards.

What a runner needs of the modules is decided here, while the parameters are still on the meta
device: FP8 block-scaled linears where the core keeps FP8 weights (flare_core.ops.fp8), the GEMV
kernel for one-token matmuls on CUDA (flare_core.kernels.gemv), a tensor-parallel rank's share and
its all-reduces (flare_core.parallel). `load_prepared_weights` then fills the parameters. The
runners take the model as it is: compiling it (flare_core.ops.model.CompiledDecoder) wraps it
without changing it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from flare_core.contract import Recipe
from flare_core.ops.fp4 import use_fp4_experts
from flare_core.ops.fp8 import use_fp8_blocks, use_fp8_experts
from flare_core.ops.linear import GemvLinear
from flare_core.ops.mlp import FusedGatedMLP
from flare_core.ops.model import DecoderForServing
from flare_core.ops.routing import SigmoidTopKRouter, SoftmaxTopKRouter
from flare_core.parallel import Ranks, build_rank_model, join_group, spec_of


@dataclass(frozen=True)
class ServingOptions:
    """How the model is built beyond its recipe. `gemv`: one-token matmuls through the GEMV kernel
    (the CUDA path); `fp8_linears` / `fp8_experts`: module paths of the linear layers and packed
    expert tensors whose weights are FP8 blocks (flare_core.ops.fp8.quantized_paths /
    quantized_experts of a core's tensor names); `fp4_experts`: packed expert tensors kept as FP4
    groups (flare_core.ops.fp4.fp4_experts); `fp8_block`: the (rows, cols) blocks the FP8 linear
    layers' scales cover (the core's weight_block_size: 128 x 128, or a checkpoint's own, DeepSeek
    V4.1's 32 x 32); `ranks`: this model is one rank of a tensor-parallel group."""

    gemv: bool = False
    fp8_linears: tuple[str, ...] = ()
    fp8_block: tuple[int, int] = (128, 128)
    fp8_experts: tuple[str, ...] = ()
    fp4_experts: tuple[str, ...] = ()
    ranks: Ranks | None = None


def serving_model(recipe: Recipe, config: Any, dtype: torch.dtype,
                  options: ServingOptions = ServingOptions()) -> nn.Module:
    """`recipe`'s model of `config` in `dtype`, built for `options`, parameters on the meta device."""
    if options.ranks is None:
        model = recipe.build_model(config, dtype)
    else:
        model = build_rank_model(recipe, config, dtype, options.ranks)
    use_fp8_blocks(model, options.fp8_linears, options.fp8_block)
    use_fp8_experts(model, options.fp8_experts)
    use_fp4_experts(model, options.fp4_experts)
    if options.gemv:  # after FP8: the FP8 linears keep their own one-token kernel
        gemv_layers(model)
    if options.ranks is not None:
        join_group(model, spec_of(recipe), options.ranks)
    return model


def _is_silu(module: nn.Module) -> bool:
    from transformers.activations import ACT2FN

    return isinstance(module, (nn.SiLU, type(ACT2FN["silu"])))


def gemv_layers(model: nn.Module) -> int:
    """Build `model`'s one-token matmuls on the GEMV kernel, in place: every bias-free nn.Linear
    is replaced by a `GemvLinear` holding the same weight Parameter, every SiLU `FusedGatedMLP`
    takes the gated kernel, a `DecoderForServing`'s head and MoE routers' logits
    (`SoftmaxTopKRouter`, `SigmoidTopKRouter`) go through `flare::linear` / `flare::linear_float32`.
    Returns how many modules it set. Called while the model is built for serving
    (`serving_model`), before any runner sees it. Without Triton or a CUDA device the ops compute
    what the modules did."""
    switched = 0
    replaced: dict[int, GemvLinear] = {}  # a Linear reached from two parents is replaced once
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.bias is None:
                if id(child) not in replaced:
                    replaced[id(child)] = _gemv_linear(child)
                    switched += 1
                setattr(parent, name, replaced[id(child)])
        if isinstance(parent, FusedGatedMLP) and _is_silu(parent.act_fn):
            parent.gated_kernel = True
            switched += 1
        elif isinstance(parent, DecoderForServing):
            parent.gemv_head = True
            switched += 1
        elif isinstance(parent, (SoftmaxTopKRouter, SigmoidTopKRouter)):
            parent.gemv_logits = True
            switched += 1
    return switched


def _gemv_linear(linear: nn.Linear) -> GemvLinear:
    """A GemvLinear over `linear`'s own weight Parameter (built on the meta device, then handed
    the Parameter: no memory is allocated and the state dict keeps its names and tensors)."""
    with torch.device("meta"):
        gemv = GemvLinear(linear.in_features, linear.out_features, bias=False, dtype=linear.weight.dtype)
    gemv.weight = linear.weight
    return gemv
