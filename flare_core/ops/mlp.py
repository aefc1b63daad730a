"""The gated MLP of Llama-style models with gate and up projections fused into one matmul."""

from __future__ import annotations

from torch import Tensor, nn


class FusedGatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), with gate and up stored as one [2 * intermediate, hidden]
    matrix (gate rows first), so the step reads both with a single matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, act_fn: nn.Module):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.act_fn = act_fn

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act_fn(gate) * up)
