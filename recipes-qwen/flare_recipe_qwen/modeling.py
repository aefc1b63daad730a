"""Qwen3 and Qwen3-MoE for serving, built from the Transformers classes.

The Transformers model is built on the meta device from the config; its embeddings, decoder
layers, norms and MoE blocks are reused as they are. Only what serving changes is replaced:
attention becomes core's `FusedQKVAttention` (fused `qkv_proj`, the original q/k norms and
`o_proj`, `PagedAttention` over the runtime cache), each dense MLP becomes `FusedGatedMLP`
(fused `gate_up_proj`) and each MoE router `SoftmaxTopKRouter` (the same softmax top-k in two
launches; flare_core.ops.routing). Prepared tensor names are the Transformers names, with those fused
tensors in place of their parts (declared in `flare_core.ops.weights`).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.models.qwen3 import modeling_qwen3
from transformers.models.qwen3_moe import modeling_qwen3_moe

from flare_core.api import DecoderForServing, FusedGatedMLP, FusedQKVAttention, SoftmaxTopKRouter
from flare_recipe_qwen import hybrid

# Transformers classes per architecture: (causal LM, attention, dense MLPs, rotary embedding).
_CLASSES = {
    "qwen3": (modeling_qwen3.Qwen3ForCausalLM, modeling_qwen3.Qwen3Attention, (modeling_qwen3.Qwen3MLP,),
              modeling_qwen3.Qwen3RotaryEmbedding),
    "qwen3_moe": (modeling_qwen3_moe.Qwen3MoeForCausalLM, modeling_qwen3_moe.Qwen3MoeAttention,
                  (modeling_qwen3_moe.Qwen3MoeMLP,), modeling_qwen3_moe.Qwen3MoeRotaryEmbedding),
}


def build_model(config: Any, dtype: torch.dtype) -> DecoderForServing:
    """Qwen3 / Qwen3-MoE serving model, or a Gated DeltaNet hybrid's (Qwen3-Next, Qwen3.5:
    flare_recipe_qwen.hybrid), with parameters on the meta device in `dtype` and the rotary
    embedding's buffers built on the CPU (see flare_core.ops.loading)."""
    if config.model_type in hybrid.MODEL_TYPES:
        return hybrid.build_model(config, dtype)
    if config.model_type not in _CLASSES:
        raise ValueError(f"config.model_type: {config.model_type!r} is not a Qwen3 model type "
                         f"({', '.join([*_CLASSES, *hybrid.MODEL_TYPES])})")
    causal_lm_class, attention_class, dense_mlp_classes, rotary_class = _CLASSES[config.model_type]
    with torch.device("meta"):
        causal_lm = causal_lm_class(config)
        for layer_idx, layer in enumerate(causal_lm.model.layers):
            if not isinstance(layer.self_attn, attention_class):
                raise ValueError(f"{causal_lm_class.__name__} layer {layer_idx}: unexpected attention module "
                                 f"{type(layer.self_attn).__name__}")
            layer.self_attn = FusedQKVAttention(layer.self_attn, config, layer_idx,
                                                modeling_qwen3.apply_rotary_pos_emb, qk_norm=True)
            if isinstance(layer.mlp, dense_mlp_classes):
                layer.mlp = FusedGatedMLP.like(layer.mlp)
            elif isinstance(getattr(layer.mlp, "gate", None), modeling_qwen3_moe.Qwen3MoeTopKRouter):
                layer.mlp.gate = SoftmaxTopKRouter.like(layer.mlp.gate, normalize=config.norm_topk_prob)
    causal_lm.to(dtype)
    with torch.device("cpu"):
        rotary_emb = rotary_class(config)
    return DecoderForServing(causal_lm, rotary_emb, bool(config.tie_word_embeddings))
