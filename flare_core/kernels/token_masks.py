"""Token bitmasks: which tokens a row may sample next (a grammar's, for structured output).

A mask row is int32 words; bit j of word w allows token 32 w + j (xgrammar's layout).
"""

from __future__ import annotations

import torch

from flare_core.requests import MASK_BITS


def apply_token_masks(logits: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """`logits` [B, V] with the tokens `masks` (int32 [B, words], same device) does not allow set
    to -inf, in place. Graph-capturable (no host synchronisation)."""
    vocab = logits.shape[-1]
    bits = torch.arange(MASK_BITS, dtype=torch.int32, device=masks.device)
    allowed = ((masks[:, :, None] >> bits) & 1).view(masks.shape[0], -1)[:, :vocab]
    return logits.masked_fill_(allowed == 0, float("-inf"))
