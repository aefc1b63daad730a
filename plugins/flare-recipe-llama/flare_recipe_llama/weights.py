"""Llama checkpoint tensors -> the prepared layout of `flare_recipe_llama.model`.

Names stay the Transformers names except the fused matrices `flare_core.ops.weights` declares:
`self_attn.qkv_proj.weight` = cat(q_proj, k_proj, v_proj) and `mlp.gate_up_proj.weight` =
cat(gate_proj, up_proj), both along the output dimension. A tied checkpoint has no
`lm_head.weight`, and the serving model needs none.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping

import torch
from torch import Tensor

from flare_core.api import checkpoint_reader, prepare_weights
from flare_recipe_llama.model import build_model


def map_weights(config: Any, checkpoint: Mapping[str, Tensor], dtype: torch.dtype) -> Iterator[tuple[str, Tensor]]:
    """Yield (prepared name, tensor in `dtype`) for every tensor the serving model loads; the
    names come from the model itself (built on the meta device), so the two cannot drift."""
    yield from prepare_weights(build_model(config, dtype), checkpoint_reader(checkpoint))
