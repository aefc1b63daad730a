"""Routed experts in a Transformers MoE model built for serving: `use_fused_experts` registers
`flare::routed_experts` (flare_core.kernels.moe, whose docstring says which kernels a step takes)
with Transformers' experts interface, so every experts class decorated with
`@use_experts_implementation` (Qwen3-MoE, DeepSeek-V3 and the families built like them) runs it
in place of its expert loop. The family's router (Transformers' or flare_core.ops.routing's)
hands the experts module `top_k_index` / `top_k_weights` as before. Experts whose gate is
SiLU(gate) * up with both clamped at a limit (DeepSeek V4's: `clamped_swiglu`) take the op too,
their limit passed to it. Experts kept as FP8 blocks (flare_core.ops.fp8) or FP4 groups
(flare_core.ops.fp4) hand the op their scales."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from flare_core.kernels import fp4, fp8
from flare_core.kernels.moe import MAX_PAIRS_PER_EXPERT

# The implementations' names in Transformers' experts interface: the op, and Transformers'
# grouped_mm for experts the op does not compute (both take an expert-parallel rank's routes).
EXPERTS_IMPLEMENTATION = "flare"
GROUPED_MM_IMPLEMENTATION = "flare_grouped_mm"


# Transformers' default gate (`transformers.integrations.moe._default_apply_gate`), looked up when
# the experts are switched (`use_fused_experts`): an import inside the experts' forward stops
# torch.compile (Transformers' modules are lazy).
_DEFAULT_GATES: list = [None]


def _default_gate(experts: nn.Module) -> bool:
    return getattr(type(experts), "_apply_gate", None) in _DEFAULT_GATES


def _fusable(experts: nn.Module, clamped_swiglu: tuple[type, ...]) -> bool:
    """Whether a Transformers experts module computes what the op does: concatenated [gate; up]
    rows [E, 2I, hidden], no biases, no post-expert norm, SiLU gating, or a class of
    `clamped_swiglu` (gate and up clamped at its `limit` first). (Transformers releases before
    these flags existed had only that layout: a missing flag reads as it.)"""
    from transformers.activations import ACT2FN

    gate = _default_gate(experts) or (isinstance(experts, clamped_swiglu) and hasattr(experts, "limit"))
    return (getattr(experts, "has_gate", True) and getattr(experts, "is_concatenated", True)
            and not getattr(experts, "has_bias", False) and not getattr(experts, "is_transposed", False)
            and not getattr(experts, "has_post_expert_norm", False) and gate
            and isinstance(getattr(experts, "act_fn", None), (nn.SiLU, type(ACT2FN["silu"]))))


def _scale(experts: nn.Module, leaf: str) -> Tensor | None:
    """The scales of a packed expert tensor kept as FP8 blocks or FP4 groups, None for 16 bits."""
    for suffix in (fp8.SCALE_SUFFIX, fp4.SCALE_SUFFIX):
        scale = getattr(experts, leaf + suffix, None)
        if scale is not None:
            return scale
    return None


def held_routes(experts: nn.Module, top_k_index: Tensor, top_k_weights: Tensor) -> tuple[Tensor, Tensor]:
    """The routes as an expert-parallel rank's experts module takes them (flare_core.parallel:
    `first_expert` set, `num_experts` held): global ids made local, a route to another rank's
    expert the sentinel id `num_experts` with weight 0 (as Transformers' `AllReduceEP` marks them).
    Unchanged for a module that holds every expert."""
    first = getattr(experts, "first_expert", None)
    if first is None:
        return top_k_index, top_k_weights
    local = top_k_index - first
    elsewhere = (local < 0) | (local >= experts.num_experts)
    return local.masked_fill(elsewhere, experts.num_experts), top_k_weights.masked_fill(elsewhere, 0.0)


def _experts_forward(self: nn.Module, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
    top_k_index, top_k_weights = held_routes(self, top_k_index, top_k_weights)
    gate_up_scale, down_scale = _scale(self, "gate_up_proj"), _scale(self, "down_proj")
    # The op runs only over experts `_fusable` admitted: a gate other than the default is clamped.
    swiglu_limit = 0.0 if _default_gate(self) else float(self.limit)
    # Under torch.compile the token count is settled when tracing: prompt chunks and decode
    # batches compile apart, as for one_token (flare_core.ops.linear). FP8 experts take the op at
    # every size: grouped_mm reads 16-bit weights.
    if (top_k_index.numel() > MAX_PAIRS_PER_EXPERT * self.gate_up_proj.shape[0] and gate_up_scale is None
            and down_scale is None):
        from transformers.integrations.moe import grouped_mm_experts_forward

        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    return _held_experts(self, hidden_states, top_k_index, top_k_weights, swiglu_limit).sum(dim=1).to(
        hidden_states.dtype)


def _grouped_mm_forward(self: nn.Module, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
    from transformers.integrations.moe import grouped_mm_experts_forward

    return grouped_mm_experts_forward(self, hidden_states, *held_routes(self, top_k_index, top_k_weights))


def routed_experts(experts: nn.Module, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor,
                   swiglu_limit: float = 0.0) -> Tensor:
    """`flare::routed_experts` over a packed experts module (`gate_up_proj` [E, 2I, hidden], gate
    rows first, and `down_proj` [E, hidden, I]) with the scales its tensors carry where the core
    keeps them as FP8 blocks or FP4 groups: [T, k, hidden] float32, each (token, expert) pair's
    SiLU-gated output times its weight (gate and up clamped at `swiglu_limit` > 0); on an
    expert-parallel rank (`held_routes`) zero for the pairs of another rank's experts. No host
    sync: a recipe's own experts module runs it in captured graphs."""
    top_k_index, top_k_weights = held_routes(experts, top_k_index, top_k_weights)
    return _held_experts(experts, hidden_states, top_k_index, top_k_weights, swiglu_limit)


def _held_experts(experts: nn.Module, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor,
                  swiglu_limit: float) -> Tensor:
    return torch.ops.flare.routed_experts(hidden_states, experts.gate_up_proj, experts.down_proj, top_k_index,
                                          top_k_weights, _scale(experts, "gate_up_proj"), _scale(experts, "down_proj"),
                                          swiglu_limit)


def use_fused_experts(causal_lm: nn.Module, clamped_swiglu: tuple[type, ...] = ()) -> bool:
    """Run a Transformers MoE model's experts through `flare::routed_experts` when every experts
    module is one the op computes exactly (else Transformers' `grouped_mm`, which also keeps
    fixed shapes for CUDA graphs: its default loop finds the experts in use with a host sync).
    `clamped_swiglu`: experts classes whose gate clamps gate and up at their `limit` (the family
    says so: a gate is never guessed from its code). Either way an expert-parallel rank's routes
    are made its own (`held_routes`). Returns whether the op is used; a model without switchable
    experts is left as it is."""
    can_set = getattr(type(causal_lm), "_can_set_experts_implementation", None)
    if can_set is None or not can_set():
        return False
    from transformers.integrations import moe
    from transformers.integrations.moe import ExpertsInterface

    _DEFAULT_GATES[1:] = [getattr(moe, "_default_apply_gate", None)]
    ExpertsInterface.register(EXPERTS_IMPLEMENTATION, _experts_forward)
    ExpertsInterface.register(GROUPED_MM_IMPLEMENTATION, _grouped_mm_forward)
    experts = [m for m in causal_lm.modules() if isinstance(getattr(m, "gate_up_proj", None), nn.Parameter)]
    fused = bool(experts) and all(_fusable(m, clamped_swiglu) for m in experts)
    causal_lm.set_experts_implementation(EXPERTS_IMPLEMENTATION if fused else GROUPED_MM_IMPLEMENTATION)
    return fused
