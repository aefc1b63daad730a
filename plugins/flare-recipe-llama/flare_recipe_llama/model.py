"""Llama for serving: the Transformers LlamaForCausalLM with attention over Flare's paged cache.

The Transformers model stays the definition of the architecture. We build it on the meta
device (no memory), keep its embeddings, decoder layers and norms, and replace two modules:

* each layer's `self_attn` by core's `FusedQKVAttention`: one fused `qkv_proj`, Llama's rotary
  embedding, `flare_core.ops.attention.PagedAttention` over the runtime cache, the original
  `o_proj`;
* each layer's `mlp` by `FusedGatedMLP`: one fused `gate_up_proj`, the original activation.

The decoder layers pass unknown keyword arguments on to `self_attn`, which is how the Flare
forward context reaches the attention without changing the layers.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.models.llama.modeling_llama import LlamaForCausalLM, LlamaRotaryEmbedding, apply_rotary_pos_emb

from flare_core.api import ContractError, DecoderForServing, FusedGatedMLP, FusedQKVAttention, check_rope_type


def check_config(config: Any) -> None:
    """Reject structure this recipe does not implement, naming the config field."""
    if config.attention_bias or config.mlp_bias:
        field = "attention_bias" if config.attention_bias else "mlp_bias"
        raise ContractError("LlamaConfig", field, "is true; this recipe implements projections without bias")
    if config.num_attention_heads % config.num_key_value_heads != 0:
        raise ContractError("LlamaConfig", "num_key_value_heads", f"{config.num_key_value_heads} does not divide "
                            f"num_attention_heads {config.num_attention_heads}")
    check_rope_type(config)


def build_model(config: Any, dtype: torch.dtype) -> DecoderForServing:
    """Parameters on the meta device in `dtype`; the rotary buffers (not part of the prepared
    weights) are built on the CPU so they are real after loading."""
    with torch.device("meta"):
        causal_lm = LlamaForCausalLM(config)
        for layer_idx, layer in enumerate(causal_lm.model.layers):
            layer.self_attn = FusedQKVAttention(layer.self_attn, config, layer_idx, apply_rotary_pos_emb)
            layer.mlp = FusedGatedMLP.like(layer.mlp)
    causal_lm.to(dtype)
    with torch.device("cpu"):
        rotary_emb = LlamaRotaryEmbedding(config)
    return DecoderForServing(causal_lm, rotary_emb, bool(config.tie_word_embeddings))
