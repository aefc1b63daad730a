"""Checkpoint tensors -> the prepared layout of `flare_recipe_qwen.modeling`.

Real Qwen3 checkpoints name tensors as Transformers' `save_pretrained` writes them: separate
`q_proj`/`k_proj`/`v_proj`, `gate_proj`/`up_proj`, and one set of matrices per expert. The
prepared layout fuses and packs them as `flare_core.ops.weights` declares (`qkv_proj`,
`gate_up_proj`, `experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]); a tied
checkpoint has no `lm_head.weight` and needs none. Checkpoint tensors nobody needs are ignored.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

from flare_core.api import checkpoint_reader, prepare_weights
from flare_recipe_qwen.modeling import build_model


# Qwen3.5's vision-language checkpoints keep the text model under `model.language_model.` (the vision
# tower under `model.visual.`, unused here); Transformers' conversion for qwen3_5_text strips it.
LANGUAGE_MODEL = "model.language_model."


def text_model_names(checkpoint: Mapping[str, Tensor]) -> dict[str, str]:
    """Transformers' text-model name (`model.layers.0...`) -> checkpoint name, for the tensors a
    checkpoint holds under `model.language_model.`; other names are the checkpoint's own."""
    return {"model." + name[len(LANGUAGE_MODEL):]: name for name in checkpoint if name.startswith(LANGUAGE_MODEL)}


def map_text_model_weights(config: Any, checkpoint: Mapping[str, Tensor],
                           dtype: torch.dtype) -> Iterator[tuple[str, Tensor]]:
    """`map_weights` of a text model read from a vision-language checkpoint (or a text-only one)."""
    names, read = text_model_names(checkpoint), checkpoint_reader(checkpoint)
    yield from _prepared(config, lambda name, target, to: read(names.get(name, name), target, to), dtype)


def map_weights(config: Any, checkpoint: Mapping[str, Tensor], dtype: torch.dtype) -> Iterator[tuple[str, Tensor]]:
    """Yield (prepared name, tensor in `dtype`) for every tensor the serving model loads.
    Raises ValueError naming the checkpoint tensor when one is missing."""
    yield from _prepared(config, checkpoint_reader(checkpoint), dtype)


def _prepared(config: Any, read, dtype: torch.dtype) -> Iterator[tuple[str, Tensor]]:
    """The serving model's prepared tensors, each part read through `read` (flare_core.ops.weights)."""
    yield from prepare_weights(build_model(config, dtype), read, num_experts=getattr(config, "num_experts", 0) or 0)
