"""Checkpoint tensors -> the prepared layout of `flare_recipe_deepseek.modeling`.

Real DeepSeek-V3 / Kimi K2 checkpoints name tensors as Transformers' `save_pretrained` writes
them: `self_attn.kv_b_proj.weight`, separate `gate_proj`/`up_proj`, one set of matrices per
routed expert (`mlp.experts.{i}.gate_proj.weight`, ...). DeepSeek's checkpoints also carry the
multi-token-prediction module as layer `model.layers.{num_hidden_layers}.*`; the serving model
has no such layer, so nothing asks for those tensors and they are never read. The prepared layout:

* `self_attn.w_uk` = kv_b_proj rows of the no-rope key part, per head: [H, nope, kv_lora_rank]
* `self_attn.w_uv` = kv_b_proj rows of the value part, per head, transposed: [H, kv_lora_rank, v]
* `...gate_up_proj.weight` = cat(gate_proj, up_proj) (dense layers and shared experts)
* `mlp.experts.gate_up_proj` = stack over experts of cat(gate_proj, up_proj): [E, 2I, hidden]
* `mlp.experts.down_proj`    = stack over experts of down_proj: [E, hidden, I]
* everything else keeps its name.

The split of kv_b_proj is done in float32 and cast once at the end. The prepared names, shapes
and dtypes come from the serving model itself, so the mapping and the model cannot drift apart.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping

import torch
from torch import Tensor

from flare_recipe_deepseek.modeling import build_model

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def map_weights(config: Any, checkpoint: Mapping[str, Tensor], dtype: torch.dtype) -> Iterator[tuple[str, Tensor]]:
    """Yield (prepared name, tensor) for every tensor the serving model loads, in the model's dtype
    for it (`dtype`; float32 for the router bias). Raises ValueError naming the checkpoint tensor
    when one is missing or is stored in fp8."""
    for name, target in build_model(config, dtype).state_dict().items():
        yield name, _prepare(name, checkpoint, config).to(target.dtype).contiguous()


def _prepare(name: str, checkpoint: Mapping[str, Tensor], config: Any) -> Tensor:
    prefix, _, leaf = name.rpartition(".mlp.experts.")
    if leaf == "gate_up_proj":
        return torch.stack([torch.cat([_take(checkpoint, f"{prefix}.mlp.experts.{e}.gate_proj.weight", name),
                                       _take(checkpoint, f"{prefix}.mlp.experts.{e}.up_proj.weight", name)])
                            for e in range(config.n_routed_experts)])
    if leaf == "down_proj":
        return torch.stack([_take(checkpoint, f"{prefix}.mlp.experts.{e}.down_proj.weight", name)
                            for e in range(config.n_routed_experts)])
    if name.endswith(".self_attn.w_uk") or name.endswith(".self_attn.w_uv"):
        source = name.rpartition(".")[0] + ".kv_b_proj.weight"
        w_uk, w_uv = split_kv_b_proj(_take(checkpoint, source, name), config)
        return w_uk if name.endswith("w_uk") else w_uv
    if name.endswith(".gate_up_proj.weight"):
        base = name.removesuffix("gate_up_proj.weight")
        return torch.cat([_take(checkpoint, f"{base}{part}_proj.weight", name) for part in ("gate", "up")])
    return _take(checkpoint, name, name)


def split_kv_b_proj(kv_b_proj: Tensor, config: Any) -> tuple[Tensor, Tensor]:
    """kv_b_proj [H * (nope + v), kv_lora_rank] -> (w_uk [H, nope, kv_lora_rank],
    w_uv [H, kv_lora_rank, v]), in float32."""
    heads, nope, v = config.num_attention_heads, config.qk_nope_head_dim, config.v_head_dim
    expected = (heads * (nope + v), config.kv_lora_rank)
    if tuple(kv_b_proj.shape) != expected:
        raise ValueError(f"kv_b_proj.weight has shape {tuple(kv_b_proj.shape)}, the config needs {expected} "
                         f"(num_attention_heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank)")
    per_head = kv_b_proj.float().view(heads, nope + v, config.kv_lora_rank)
    return per_head[:, :nope, :].contiguous(), per_head[:, nope:, :].transpose(1, 2).contiguous()


def _take(checkpoint: Mapping[str, Tensor], source: str, target: str) -> Tensor:
    if source not in checkpoint:
        raise ValueError(f"checkpoint lacks tensor {source!r} (needed for prepared tensor {target!r})")
    tensor = checkpoint[source]
    if tensor.dtype in _FP8:
        raise ValueError(f"checkpoint tensor {source!r} is {tensor.dtype}: fp8 block-quantized checkpoints are not "
                         "supported; use a bfloat16 checkpoint")
    return tensor
