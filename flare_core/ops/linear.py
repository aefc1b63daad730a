"""Linear layers of a model built for serving: `GemvLinear`, whose calls of one to a few tokens take
the GEMV kernels (flare_core.kernels.gemv), and `one_token` / `few_tokens`, the tests a layer makes
before it picks such a kernel."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flare_core.kernels.gemv import FEW_TOKENS  # importing it registers the flare::linear ops called here


def one_token(x: Tensor) -> bool:
    """Whether activations [..., features] hold a single token. Under torch.compile this is
    settled when tracing (one-token steps compile apart from others), so steps of several tokens
    keep plain matmuls that Inductor schedules and fuses with the code around them."""
    return x.numel() == x.shape[-1]


def few_tokens(x: Tensor) -> bool:
    """Whether activations [..., features] hold at most FEW_TOKENS tokens: decode batches and
    speculative rounds of a few rows, whose matmuls the GEMV kernels serve (one token, or a few
    through `gemv_tokens`). Under torch.compile this is settled when tracing, as `one_token` is
    (steps of one, of a few and of more tokens compile apart)."""
    return x.numel() <= FEW_TOKENS * x.shape[-1]


class GemvLinear(nn.Linear):
    """A bias-free nn.Linear whose calls of one to a few tokens run the GEMV kernels (same
    parameters, same state dict)."""

    def forward(self, x: Tensor) -> Tensor:
        if few_tokens(x):
            return torch.ops.flare.linear(x, self.weight)
        return F.linear(x, self.weight)
