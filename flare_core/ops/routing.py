"""The top-k routers of mixture-of-experts layers as serving modules: each a logits matmul and one
routing op (flare_core.kernels.routing, whose docstring says how they compute and what they save).
Same parameters and buffers, same state dicts as the Transformers routers they replace."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flare_core.kernels import routing  # noqa: F401 - registers the flare::*_top_k ops the routers call
from flare_core.ops.linear import one_token


class SoftmaxTopKRouter(nn.Module):
    """A Transformers softmax top-k router (`weight` [E, hidden]; forward returns router logits,
    top-k weights and expert ids) computed by the ops above. Same parameter, same state dict."""

    def __init__(self, hidden_size: int, experts: int, top_k: int, normalize: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, hidden_size))
        self.top_k = top_k
        self.normalize = normalize
        # Set by flare_core.ops.serving.gemv_layers: one token's logits through flare::linear.
        self.gemv_logits = False

    @classmethod
    def like(cls, router: nn.Module, normalize: bool) -> SoftmaxTopKRouter:
        """The replacement of a Transformers router that computes softmax, topk and (when the
        family's forward does: `normalize`) the division by the sum."""
        experts, hidden_size = router.weight.shape
        return cls(hidden_size, experts, router.top_k, normalize)

    def forward(self, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        hidden_states = hidden_states.reshape(-1, self.weight.shape[1])
        if self.gemv_logits and one_token(hidden_states):
            logits = torch.ops.flare.linear(hidden_states, self.weight)
        else:
            logits = F.linear(hidden_states, self.weight)
        weights, ids = torch.ops.flare.softmax_top_k(logits, self.top_k, self.normalize)
        return logits, weights, ids


class SigmoidTopKRouter(nn.Module):
    """A Transformers sigmoid top-k router with score correction bias and group limits
    (DeepSeek-V3's `DeepseekV3TopkRouter`, Kimi Linear's `KimiLinearTopkRouter`: `weight` [E,
    hidden], the buffer `e_score_correction_bias` [E]; forward returns float32 router logits,
    top-k weights and expert ids) computed by the ops above. Same parameter and buffer, same
    state dict."""

    def __init__(self, hidden_size: int, experts: int, top_k: int, groups: int, top_groups: int, normalize: bool,
                 scale: float):
        super().__init__()
        per_group = experts // groups if groups > 0 else 0
        if (not per_group or experts % groups or not 1 <= top_groups <= groups or top_k > top_groups * per_group
                or (top_groups < groups and per_group < 2)):
            raise ValueError(f"router: {experts} experts in {groups} groups, {top_groups} kept, top-{top_k}: the "
                             "groups must divide the experts, hold two each when some are left out, and the kept "
                             "groups at least top-k experts")
        self.weight = nn.Parameter(torch.empty(experts, hidden_size))
        self.e_score_correction_bias = nn.Buffer(torch.zeros(experts))
        self.top_k, self.groups, self.top_groups = top_k, groups, top_groups
        self.normalize, self.scale = normalize, float(scale)
        # Set by flare_core.ops.serving.gemv_layers: one token's logits through the GEMV kernel.
        self.gemv_logits = False

    @classmethod
    def like(cls, router: nn.Module) -> SigmoidTopKRouter:
        """The replacement of a Transformers router of this kind (its fields read from it)."""
        experts, hidden_size = router.weight.shape
        return cls(hidden_size, experts, router.top_k, router.num_group, router.topk_group, router.norm_topk_prob,
                   router.routed_scaling_factor)

    def forward(self, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        hidden_states = hidden_states.reshape(-1, self.weight.shape[1])
        if self.gemv_logits and one_token(hidden_states):
            logits = torch.ops.flare.linear_float32(hidden_states, self.weight)
        else:
            logits = F.linear(hidden_states.float(), self.weight.float())
        weights, ids = torch.ops.flare.sigmoid_top_k(logits, self.e_score_correction_bias, self.top_k, self.groups,
                                                     self.top_groups, self.normalize, self.scale)
        return logits, weights, ids
