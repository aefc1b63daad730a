"""Llama checkpoint tensors -> the prepared layout of `flare_recipe_llama.model`.

Names stay the Transformers names except the two fused matrices:
`self_attn.qkv_proj.weight` = cat(q_proj, k_proj, v_proj) and `mlp.gate_up_proj.weight` =
cat(gate_proj, up_proj), both along the output dimension. A tied checkpoint has no
`lm_head.weight`, and the serving model needs none.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping

import torch
from torch import Tensor

from flare_recipe_llama.model import build_model

# fused tensor -> its parts, all in the same module (self_attn / mlp)
_FUSED = {
    "qkv_proj.weight": ("q_proj.weight", "k_proj.weight", "v_proj.weight"),
    "gate_up_proj.weight": ("gate_proj.weight", "up_proj.weight"),
}


def map_weights(config: Any, checkpoint: Mapping[str, Tensor], dtype: torch.dtype) -> Iterator[tuple[str, Tensor]]:
    """Yield (prepared name, tensor in `dtype`) for every tensor the serving model loads; the
    names come from the model itself (built on the meta device), so the two cannot drift."""
    for name in build_model(config, dtype).state_dict():
        yield name, _prepare(name, checkpoint).to(dtype)


def _prepare(name: str, checkpoint: Mapping[str, Tensor]) -> Tensor:
    for fused, parts in _FUSED.items():
        if name.endswith("." + fused):
            module = name.removesuffix(fused)
            return torch.cat([_take(checkpoint, module + part, name) for part in parts])
    return _take(checkpoint, name, name)


def _take(checkpoint: Mapping[str, Tensor], source: str, target: str) -> Tensor:
    if source not in checkpoint:
        raise ValueError(f"checkpoint lacks tensor {source!r} (needed for prepared tensor {target!r})")
    return checkpoint[source]
