"""The gated MLP of Llama-style models with gate and up projections fused into one matmul."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from flare_core.ops.linear import few_tokens


class FusedGatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), with gate and up stored as one [2 * intermediate, hidden]
    matrix (gate rows first), so the step reads both with a single matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, act_fn: nn.Module):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.act_fn = act_fn
        # Set by flare_core.ops.serving.gemv_layers when act_fn is SiLU: steps of one to a few
        # tokens then read gate and up and apply silu(gate) * up in one GEMV kernel.
        self.gated_kernel = False

    @classmethod
    def like(cls, mlp: nn.Module) -> FusedGatedMLP:
        """The fused replacement of a Transformers gated MLP (gate_proj, up_proj, down_proj, act_fn)."""
        return cls(mlp.gate_proj.in_features, mlp.gate_proj.out_features, mlp.act_fn)

    def forward(self, x: Tensor) -> Tensor:
        if self.gated_kernel and few_tokens(x):
            scale_inv = getattr(self.gate_up_proj, "weight_scale_inv", None)  # FP8 weights (flare_core.ops.fp8)
            if scale_inv is not None:
                return self.down_proj(torch.ops.flare.fp8_gated_linear(x, self.gate_up_proj.weight, scale_inv))
            return self.down_proj(torch.ops.flare.gated_linear(x, self.gate_up_proj.weight))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act_fn(gate) * up)
