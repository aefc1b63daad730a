"""Routed experts in a Transformers MoE model built for serving: `use_fused_experts` registers
`flare::routed_experts` (flare_core.kernels.moe, whose docstring says which kernels a step takes)
with Transformers' experts interface, so every experts class decorated with
`@use_experts_implementation` (Qwen3-MoE, DeepSeek-V3 and the families built like them) runs it
in place of its expert loop. The family's router (Transformers' or flare_core.ops.routing's)
hands the experts module `top_k_index` / `top_k_weights` as before."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from flare_core.kernels.moe import MAX_PAIRS_PER_EXPERT

# The implementation's name in Transformers' experts interface.
EXPERTS_IMPLEMENTATION = "flare"


def _fusable(experts: nn.Module) -> bool:
    """Whether a Transformers experts module computes what the op does: concatenated [gate; up]
    rows [E, 2I, hidden], no biases, no post-expert norm, SiLU gating. (Transformers releases
    before these flags existed had only that layout: a missing flag reads as it.)"""
    from transformers.activations import ACT2FN
    from transformers.integrations import moe

    apply_gate = getattr(type(experts), "_apply_gate", None)
    return (getattr(experts, "has_gate", True) and getattr(experts, "is_concatenated", True)
            and not getattr(experts, "has_bias", False) and not getattr(experts, "is_transposed", False)
            and not getattr(experts, "has_post_expert_norm", False)
            and apply_gate in (None, getattr(moe, "_default_apply_gate", None))
            and isinstance(getattr(experts, "act_fn", None), (nn.SiLU, type(ACT2FN["silu"]))))


def _experts_forward(self: nn.Module, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
    gate_up_scale = getattr(self, "gate_up_proj_scale_inv", None)  # FP8 experts (flare_core.ops.fp8)
    down_scale = getattr(self, "down_proj_scale_inv", None)
    # Under torch.compile the token count is settled when tracing: prompt chunks and decode
    # batches compile apart, as for one_token (flare_core.ops.linear). FP8 experts take the op at
    # every size: grouped_mm reads 16-bit weights.
    if (top_k_index.numel() > MAX_PAIRS_PER_EXPERT * self.gate_up_proj.shape[0] and gate_up_scale is None
            and down_scale is None):
        from transformers.integrations.moe import grouped_mm_experts_forward

        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    pairs = torch.ops.flare.routed_experts(hidden_states, self.gate_up_proj, self.down_proj, top_k_index,
                                           top_k_weights, gate_up_scale, down_scale)
    return pairs.sum(dim=1).to(hidden_states.dtype)


def use_fused_experts(causal_lm: nn.Module) -> bool:
    """Run a Transformers MoE model's experts through `flare::routed_experts` when every experts
    module is one the op computes exactly (else Transformers' `grouped_mm`, which also keeps
    fixed shapes for CUDA graphs: its default loop finds the experts in use with a host sync).
    Returns whether the op is used; a model without switchable experts is left as it is."""
    can_set = getattr(type(causal_lm), "_can_set_experts_implementation", None)
    if can_set is None or not can_set():
        return False
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(EXPERTS_IMPLEMENTATION, _experts_forward)
    experts = [m for m in causal_lm.modules() if isinstance(getattr(m, "gate_up_proj", None), nn.Parameter)]
    fused = bool(experts) and all(_fusable(m) for m in experts)
    causal_lm.set_experts_implementation(EXPERTS_IMPLEMENTATION if fused else "grouped_mm")
    return fused
