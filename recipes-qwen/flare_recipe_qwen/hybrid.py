"""Qwen3-Next and Qwen3.5 (dense and MoE, text) for serving: Gated DeltaNet (linear attention with
a recurrent state) interleaved with gated full attention, built from the Transformers classes.

Transformers' decoder layers, norms, rotary embeddings and MoE blocks are reused as they are.
Replaced for serving:

* each Gated DeltaNet layer keeps Transformers' parameters and projections but continues its
  requests' state rows (flare_core.ops.delta_rule): on the CPU with Transformers' own chunked
  (prompt) and recurrent (one token) gated delta rules, on CUDA with flash-linear-attention's
  kernels (`flare::gated_delta_rule`); Qwen3-Next and Qwen3.5 differ only in how they project
  the input;
* each full-attention layer attends over the paged K/V cache (`PagedAttention`), with q (and its
  gate), k and v projected by one fused matrix, the q/k norms, partial rotary embedding and
  sigmoid output gate;
* Qwen3.5's Gated DeltaNet reads its four input projections as one fused matrix;
* dense MLPs (and each MoE block's shared expert) fuse gate and up (`FusedGatedMLP`), and MoE
  routers compute their softmax top-k with flare's ops (`SoftmaxTopKRouter`).

The cache scheme (`gated_deltanet_hybrid_scheme`) keeps K/V pages for the full-attention layers
only and two state tensors for the linear ones. Prepared tensor names are the Transformers names.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.models.qwen3_next import modeling_qwen3_next as qn

from flare_core.api import (
    CacheScheme, DecoderForServing, DeltaRuleForServing, ForwardContext, FusedGatedMLP, PagedAttention, PagedStore,
    SoftmaxTopKRouter, StateTensor, fused_linear, gated_delta_rule,
)

LINEAR, FULL = "linear_attention", "full_attention"


def gated_deltanet_hybrid_scheme(config: Any, dtype: str) -> CacheScheme:
    """K and V pages for the full-attention layers; for the Gated DeltaNet layers the convolution
    window ("conv": [conv channels, kernel - 1], in the cache dtype) and the recurrent state
    ("recurrent": [value heads, key head dim, value head dim], float32 as the delta rule keeps it)."""
    full = tuple(i for i, kind in enumerate(config.layer_types) if kind == FULL)
    linear = tuple(i for i, kind in enumerate(config.layer_types) if kind == LINEAR)
    conv_channels = 2 * config.linear_num_key_heads * config.linear_key_head_dim + \
        config.linear_num_value_heads * config.linear_value_head_dim
    record = (config.num_key_value_heads, config.head_dim)
    # (A config of full-attention layers only, the MTP draft head's, keeps no state.)
    state = () if not linear else (
        StateTensor("conv", (conv_channels, config.linear_conv_kernel_dim - 1), dtype, len(linear), layer_ids=linear),
        StateTensor("recurrent", (config.linear_num_value_heads, config.linear_key_head_dim,
                                  config.linear_value_head_dim), "float32", len(linear), layer_ids=linear))
    return CacheScheme(
        name="gated-deltanet-hybrid",
        paged=(PagedStore("k", record, dtype, len(full), layer_ids=full),
               PagedStore("v", record, dtype, len(full), layer_ids=full)),
        state=state,
    )


class GatedDeltaNetForServing(DeltaRuleForServing):
    """A Qwen Gated DeltaNet layer (its parameters, under their names) over the runtime's state rows
    (flare_core.ops.delta_rule). Subclasses give `project_inputs(hidden_states)` -> (q/k/v
    channels [tokens, conv channels], z, b, a)."""

    # Where flash-linear-attention is installed, Transformers' decorator swaps these names for its
    # kernels (CUDA only); the CPU reference keeps the torch functions underneath.
    recurrent_rule = staticmethod(inspect.unwrap(qn.torch_recurrent_gated_delta_rule))
    chunk_rule = staticmethod(inspect.unwrap(qn.torch_chunk_gated_delta_rule))
    kernel_rule = staticmethod(gated_delta_rule)

    def __init__(self, original: nn.Module):
        super().__init__()
        for name in ("layer_idx", "activation", "num_v_heads", "num_k_heads", "head_k_dim", "head_v_dim", "key_dim",
                     "value_dim"):
            setattr(self, name, getattr(original, name))
        self.conv1d, self.dt_bias, self.A_log = original.conv1d, original.dt_bias, original.A_log
        self.norm, self.out_proj = original.norm, original.out_proj

    def project(self, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        mixed, z, b, a = self.project_inputs(hidden_states)
        return mixed, a, b, z

    def gates(self, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
        # As Transformers computes it: in float32, else A might be -inf in half precision.
        return -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias), b.sigmoid()

    def output(self, core: Tensor, z: Tensor) -> Tensor:
        core = self.norm(core.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return self.out_proj(core.reshape(1, -1, self.value_dim))


class NextGatedDeltaNet(GatedDeltaNetForServing):
    """Qwen3-Next: q, k, v and z from one projection, b and a from another, grouped per key head."""

    def __init__(self, original: qn.Qwen3NextGatedDeltaNet):
        super().__init__(original)
        self.in_proj_qkvz, self.in_proj_ba = original.in_proj_qkvz, original.in_proj_ba

    def project_inputs(self, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        query, key, value, z, b, a = qn.Qwen3NextGatedDeltaNet.fix_query_key_value_ordering(
            self, self.in_proj_qkvz(hidden_states), self.in_proj_ba(hidden_states))
        mixed = torch.cat([x.reshape(x.shape[0], x.shape[1], -1) for x in (query, key, value)], dim=-1)[0]
        return mixed, z, b, a


class Qwen35GatedDeltaNet(GatedDeltaNetForServing):
    """Qwen3.5 (dense and MoE): Transformers' four input projections (q/k/v, z, b and a) read as
    one matrix (`in_proj_qkvzba`, flare_core.ops.weights), so a decode step reads them with a
    single matmul."""

    def __init__(self, original: nn.Module):
        super().__init__(original)
        self.in_proj_qkvzba, self.split_sizes = fused_linear(original.in_proj_qkv, original.in_proj_z,
                                                             original.in_proj_b, original.in_proj_a)

    def project_inputs(self, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        mixed, z, b, a = self.in_proj_qkvzba(hidden_states).split(self.split_sizes, dim=-1)
        return mixed[0], z, b, a


class GatedAttentionForServing(nn.Module):
    """Qwen3-Next's full attention over the paged cache: the query projection also yields a
    per-head output gate, q and k are RMS-normed per head, the rotary embedding covers the
    leading part of each head."""

    def __init__(self, original: qn.Qwen3NextAttention, config: Any, layer_idx: int):
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = original.head_dim
        # q (with the gate), k and v read as one matrix (`qkv_proj`, flare_core.ops.weights).
        self.qkv_proj, self.split_sizes = fused_linear(original.q_proj, original.k_proj, original.v_proj)
        self.o_proj = original.o_proj
        self.q_norm, self.k_norm = original.q_norm, original.k_norm
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, original.scaling, layer_idx)

    def forward(self, hidden_states: Tensor, position_embeddings: tuple[Tensor, Tensor], context: ForwardContext,
                **_: Any) -> tuple[Tensor, None]:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        tokens = x.shape[0]
        query_gate, key, value = self.qkv_proj(x).split(self.split_sizes, dim=-1)
        query, gate = query_gate.reshape(tokens, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        query = self.q_norm(query)
        key = self.k_norm(key.reshape(tokens, self.num_kv_heads, self.head_dim))
        value = value.reshape(tokens, self.num_kv_heads, self.head_dim)
        cos, sin = position_embeddings
        query, key = qn.apply_rotary_pos_emb(query, key, cos, sin, unsqueeze_dim=1)
        out = self.attn(query, key, value, context).reshape(tokens, -1) * torch.sigmoid(gate.reshape(tokens, -1))
        return self.o_proj(out).reshape(shape), None  # layers unpack (output, weights)


@dataclass(frozen=True)
class Family:
    """What differs between the hybrid families: the Transformers causal LM, the serving Gated
    DeltaNet, the dense MLP class and the rotary embedding class."""

    causal_lm: type
    delta_net: type[GatedDeltaNetForServing]
    mlp: type
    rotary: type


# The config model_types `family` knows.
MODEL_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")


def family(model_type: str) -> Family | None:
    """The hybrid family of a config's `model_type` (Transformers imported only for that one), or None."""
    if model_type == "qwen3_next":
        return Family(qn.Qwen3NextForCausalLM, NextGatedDeltaNet, qn.Qwen3NextMLP, qn.Qwen3NextRotaryEmbedding)
    if model_type == "qwen3_5_text":
        from transformers.models.qwen3_5 import modeling_qwen3_5 as q35

        return Family(q35.Qwen3_5ForCausalLM, Qwen35GatedDeltaNet, q35.Qwen3_5MLP, q35.Qwen3_5TextRotaryEmbedding)
    if model_type == "qwen3_5_moe_text":
        from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as q35m

        return Family(q35m.Qwen3_5MoeForCausalLM, Qwen35GatedDeltaNet, q35m.Qwen3_5MoeMLP,
                      q35m.Qwen3_5MoeTextRotaryEmbedding)
    return None


def build_model(config: Any, dtype: torch.dtype) -> DecoderForServing:
    """A hybrid family's serving model with parameters on the meta device in `dtype` and the
    rotary embedding's buffers built on the CPU (see flare_core.ops.loading)."""
    kind = family(config.model_type)
    if kind is None:
        raise ValueError(f"config.model_type: {config.model_type!r} is not a Gated DeltaNet hybrid")
    with torch.device("meta"):
        causal_lm = kind.causal_lm(config)
        for layer_idx, layer in enumerate(causal_lm.model.layers):
            if config.layer_types[layer_idx] == LINEAR:
                layer.linear_attn = kind.delta_net(layer.linear_attn)
            else:
                layer.self_attn = GatedAttentionForServing(layer.self_attn, config, layer_idx)
            if isinstance(layer.mlp, kind.mlp):
                layer.mlp = FusedGatedMLP.like(layer.mlp)
            else:
                layer.mlp.shared_expert = FusedGatedMLP.like(layer.mlp.shared_expert)
                # Qwen3.5-MoE's router always divides by the sum (its config has no norm_topk_prob).
                layer.mlp.gate = SoftmaxTopKRouter.like(layer.mlp.gate,
                                                        normalize=getattr(config, "norm_topk_prob", True))
    causal_lm.to(dtype)
    with torch.device("cpu"):
        rotary_emb = kind.rotary(config)
    return DecoderForServing(causal_lm, rotary_emb, bool(config.tie_word_embeddings))

