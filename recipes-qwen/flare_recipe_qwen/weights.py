"""Checkpoint tensors -> the prepared layout of `flare_recipe_qwen.modeling`.

Real Qwen3 checkpoints name tensors as Transformers' `save_pretrained` writes them: separate
`q_proj`/`k_proj`/`v_proj`, `gate_proj`/`up_proj`, and one set of matrices per expert
(`mlp.experts.{i}.gate_proj.weight`, ...). The prepared layout fuses and packs them:

* `self_attn.qkv_proj.weight`  = cat(q_proj, k_proj, v_proj) along the output dimension
* `mlp.gate_up_proj.weight`    = cat(gate_proj, up_proj) (dense layers)
* `mlp.experts.gate_up_proj`   = stack over experts of cat(gate_proj, up_proj): [E, 2I, H]
* `mlp.experts.down_proj`      = stack over experts of down_proj: [E, H, I]
* everything else keeps its name; a tied checkpoint has no `lm_head.weight` and needs none.

The list of prepared names comes from the serving model itself (built on the meta device), so
the mapping and the model cannot drift apart. Checkpoint tensors nobody needs are ignored.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping

import torch
from torch import Tensor

from flare_recipe_qwen.modeling import build_model


def map_weights(config: Any, checkpoint: Mapping[str, Tensor], dtype: torch.dtype) -> Iterator[tuple[str, Tensor]]:
    """Yield (prepared name, tensor in `dtype`) for every tensor the serving model loads.
    Raises ValueError naming the checkpoint tensor when one is missing."""
    for name in build_model(config, dtype).state_dict():
        yield name, _prepare(name, checkpoint, config).to(dtype)


def _prepare(name: str, checkpoint: Mapping[str, Tensor], config: Any) -> Tensor:
    prefix, _, leaf = name.rpartition(".mlp.experts.")
    if leaf == "gate_up_proj":
        return torch.stack([torch.cat([_take(checkpoint, f"{prefix}.mlp.experts.{e}.gate_proj.weight", name),
                                       _take(checkpoint, f"{prefix}.mlp.experts.{e}.up_proj.weight", name)])
                            for e in range(config.num_experts)])
    if leaf == "down_proj":
        return torch.stack([_take(checkpoint, f"{prefix}.mlp.experts.{e}.down_proj.weight", name)
                            for e in range(config.num_experts)])
    if name.endswith(".self_attn.qkv_proj.weight"):
        base = name.removesuffix("qkv_proj.weight")
        return torch.cat([_take(checkpoint, f"{base}{part}_proj.weight", name) for part in ("q", "k", "v")])
    if name.endswith(".mlp.gate_up_proj.weight"):
        base = name.removesuffix("gate_up_proj.weight")
        return torch.cat([_take(checkpoint, f"{base}{part}_proj.weight", name) for part in ("gate", "up")])
    return _take(checkpoint, name, name)


def _take(checkpoint: Mapping[str, Tensor], source: str, target: str) -> Tensor:
    if source not in checkpoint:
        raise ValueError(f"checkpoint lacks tensor {source!r} (needed for prepared tensor {target!r})")
    return checkpoint[source]
