"""Checkpoint tensors -> the prepared layout of `flare_recipe_qwen.modeling`.

Real Qwen3 checkpoints name tensors as Transformers' `save_pretrained` writes them: separate
`q_proj`/`k_proj`/`v_proj`, `gate_proj`/`up_proj`, and one set of matrices per expert. The
prepared layout fuses and packs them as `flare_core.ops.weights` declares (`qkv_proj`,
`gate_up_proj`, `experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]); a tied
checkpoint has no `lm_head.weight` and needs none. Checkpoint tensors nobody needs are ignored.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping

import torch
from torch import Tensor

from flare_core.ops.weights import checkpoint_reader, prepare_weights
from flare_recipe_qwen.modeling import build_model


def map_weights(config: Any, checkpoint: Mapping[str, Tensor], dtype: torch.dtype) -> Iterator[tuple[str, Tensor]]:
    """Yield (prepared name, tensor in `dtype`) for every tensor the serving model loads.
    Raises ValueError naming the checkpoint tensor when one is missing."""
    yield from prepare_weights(build_model(config, dtype), checkpoint_reader(checkpoint),
                               num_experts=getattr(config, "num_experts", 0) or 0)
