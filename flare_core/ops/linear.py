"""Linear layers of a model built for serving: `GemvLinear`, whose one-token calls take the GEMV
kernel (flare_core.kernels.gemv), and `one_token`, the test every layer makes before it picks a
one-token kernel."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import flare_core.kernels.gemv  # noqa: F401 - registers the flare::linear ops this module calls


def one_token(x: Tensor) -> bool:
    """Whether activations [..., features] hold a single token. Under torch.compile this is
    settled when tracing (one-token steps compile apart from others), so steps of several tokens
    keep plain matmuls that Inductor schedules and fuses with the code around them."""
    return x.numel() == x.shape[-1]


class GemvLinear(nn.Linear):
    """A bias-free nn.Linear whose one-token calls run the GEMV kernel (same parameters, same
    state dict)."""

    def forward(self, x: Tensor) -> Tensor:
        if one_token(x):
            return torch.ops.flare.linear(x, self.weight)
        return F.linear(x, self.weight)
