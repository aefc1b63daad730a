"""Checkpoint tensors -> the prepared layout of `flare_recipe_deepseek.modeling`.

Real DeepSeek-V3 / Kimi K2 checkpoints name tensors as Transformers' `save_pretrained` writes
them: `self_attn.kv_b_proj.weight`, separate `gate_proj`/`up_proj`, one set of matrices per
routed expert (`mlp.experts.{i}.gate_proj.weight`, ...). DeepSeek's checkpoints also carry the
multi-token-prediction module as layer `model.layers.{num_hidden_layers}.*`; the serving model
has no such layer, so nothing asks for those tensors and they are never read. The prepared layout:

* `self_attn.w_uk` = kv_b_proj rows of the no-rope key part, per head: [H, nope, kv_lora_rank]
* `self_attn.w_uv` = kv_b_proj rows of the value part, per head, transposed: [H, kv_lora_rank, v]
* the fused and packed tensors `flare_core.ops.weights` declares: `gate_up_proj` (dense layers
  and shared experts), `mlp.experts.gate_up_proj` [E, 2I, hidden], `mlp.experts.down_proj`
  [E, hidden, I];
* everything else keeps its name.

fp8 block-quantized checkpoints (the published DeepSeek-V3 / V3.1 / Kimi K2 weights) are
dequantized tensor by tensor (flare_core.prepare.fp8_checkpoint): each float8_e4m3fn `X.weight` is
read with its `X.weight_scale_inv`, turned into float32 and cast to the model dtype before the next
tensor is read; only one checkpoint tensor is ever held in float32. Routed experts are written into
one preallocated [E, ...] tensor of the model dtype, expert by expert.

The split of kv_b_proj is done in float32 and cast once at the end; every other tensor is cast as
it is read (concatenation and stacking do not round, so this equals casting the fused tensor). The
prepared names, shapes and dtypes come from the serving model itself, so the mapping and the model
cannot drift apart.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping

import torch
from torch import Tensor

from flare_core.ops.weights import Reader, prepare_weights
from flare_core.prepare.fp8_checkpoint import DequantizedCheckpoint, Fp8ConfigError, fp8_blocks
from flare_recipe_deepseek.modeling import build_model


def map_weights(config: Any, checkpoint: Mapping[str, Tensor], dtype: torch.dtype) -> Iterator[tuple[str, Tensor]]:
    """Yield (prepared name, tensor) for every tensor the serving model loads, in the model's dtype
    for it (`dtype`; float32 for the router bias). fp8 block-quantized weights are dequantized.
    Raises ValueError naming the checkpoint tensor when one is missing or stored in a form the
    recipes cannot read, and naming the config field when quantization_config is unsupported."""
    try:
        blocks = fp8_blocks(config)
    except Fp8ConfigError as exc:
        raise ValueError(f"config.json {exc}") from exc
    source = DequantizedCheckpoint(checkpoint, blocks)

    def read(name: str, target: str, dtype: torch.dtype) -> Tensor:
        if name not in source:
            raise ValueError(f"checkpoint lacks tensor {name!r} (needed for prepared tensor {target!r})")
        return source[name].to(dtype)

    yield from prepare_weights(build_model(config, dtype), read, num_experts=config.n_routed_experts,
                               special=lambda name, dtype: absorbed_mla(name, read, config, dtype))


def absorbed_mla(name: str, read: Reader, config: Any, dtype: torch.dtype) -> Tensor | None:
    """Prepared tensor `name` if it is one of MLA's absorbed up-projections (`self_attn.w_uk` /
    `w_uv`), split from the checkpoint's kv_b_proj read through `read`; None for every other tensor."""
    if not (name.endswith(".self_attn.w_uk") or name.endswith(".self_attn.w_uv")):
        return None
    kv_b_proj = read(name.rpartition(".")[0] + ".kv_b_proj.weight", name, torch.float32)
    w_uk, w_uv = split_kv_b_proj(kv_b_proj, config)
    return (w_uk if name.endswith("w_uk") else w_uv).to(dtype)


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
