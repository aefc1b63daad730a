"""Kimi Linear for serving: Kimi Delta Attention (KDA, a gated delta rule with per-channel decay)
interleaved with multi-head latent attention without position encoding, and DeepSeek-style MoE,
built from the Transformers classes.

Transformers' decoder layers, norms, MoE blocks and experts are reused as they are. Replaced:

* each KDA layer keeps Transformers' parameters and continues its requests' state rows
  (flare_core.ops.delta_rule): on the CPU with Transformers' own chunked and recurrent KDA
  rules, on CUDA with flash-linear-attention's KDA kernels (`flare::kimi_delta_rule`; a decode
  step `flare::kimi_delta_rule_step`, which applies the forget gate and beta in the kernel and
  continues the rows in place);
* each MLA layer is flare_recipe_deepseek's absorbed MLA over the paged latent cache, with the
  rotation off (Kimi Linear's MLA encodes no positions; its shared key part is stored as it is);
* each KDA layer's projections of its input (q, k, v, the forget gate's and the output gate's
  first low-rank factors, b) are one fused matrix, `in_proj_qkvfgb`, and the forget gate's
  second factor sits beside it (`f_b_proj`; the forget gate module keeps its activation);
* dense MLPs and each MoE block's shared experts fuse gate and up (`FusedGatedMLP`);
* each MoE block's router is flare_core.ops.routing.SigmoidTopKRouter (DeepSeek-V3's routing as
  a logits matmul and one kernel; same weight and bias).

The cache scheme (`kda_mla_hybrid_scheme`) keeps latent pages for the MLA layers only and the
convolution window and recurrent state for the KDA layers. Prepared tensor names are the
Transformers names (read from the checkpoint's own names, `checkpoint_name`), with MLA's `w_uk`
/ `w_uv` split from `kv_b_proj` as for DeepSeek-V3.
"""

from __future__ import annotations

import inspect
import re
from typing import Any, Iterator, Mapping

import torch
from torch import Tensor
from transformers.models.kimi_linear import modeling_kimi_linear as kl

from flare_core.api import (AbsorbedMLA, CacheScheme, ContractError, DecoderForServing, DeltaRuleForServing,
                            PagedStore, StateTensor, absorbed_mla, checkpoint_reader, fused_linear,
                            keep_router_bias_float32, kimi_delta_rule, kimi_delta_rule_step, prepare_weights,
                            serve_sigmoid_moe_mlp)

LINEAR, FULL = "linear_attention", "full_attention"


def kda_mla_hybrid_scheme(config: Any, dtype: str) -> CacheScheme:
    """Latent ("ckv") and shared-key ("kpe") pages for the MLA layers; for the KDA layers the
    convolution window ("conv": [3 x heads x head dim, kernel - 1], in the cache dtype) and the
    recurrent state ("recurrent": [heads, head dim, head dim], float32 as the rule keeps it)."""
    full = tuple(i for i, kind in enumerate(config.layer_types) if kind == FULL)
    linear = tuple(i for i, kind in enumerate(config.layer_types) if kind == LINEAR)
    heads, head_dim = config.linear_num_heads, config.linear_head_dim
    return CacheScheme(
        name="kda-mla-hybrid",
        paged=(PagedStore("ckv", (config.kv_lora_rank,), dtype, len(full), layer_ids=full),
               PagedStore("kpe", (config.qk_rope_head_dim,), dtype, len(full), layer_ids=full)),
        state=(StateTensor("conv", (3 * heads * head_dim, config.linear_conv_kernel_dim - 1), dtype, len(linear),
                           layer_ids=linear),
               StateTensor("recurrent", (heads, head_dim, head_dim), "float32", len(linear), layer_ids=linear)),
    )


def check_kimi_linear_config(config: Any) -> None:
    """A Kimi Linear config this module serves; ContractError naming the field otherwise."""
    obj = type(config).__name__
    if config.model_type != "kimi_linear":
        raise ContractError(obj, "model_type", f"is {config.model_type!r}, expected 'kimi_linear'")
    kinds = set(config.layer_types)
    if not kinds <= {LINEAR, FULL} or len(config.layer_types) != config.num_hidden_layers:
        raise ContractError(obj, "layer_types", f"holds {sorted(map(str, kinds))} over {len(config.layer_types)} "
                            f"of {config.num_hidden_layers} layers; recipe kimi-linear implements one "
                            f"{LINEAR!r} (KDA) or {FULL!r} (MLA) layer each")
    if FULL not in kinds:
        raise ContractError(obj, "layer_types", "has no full_attention (MLA) layer; the kda-mla-hybrid cache "
                            "scheme pages the MLA layers' latents")
    if not set(config.mlp_layer_types) <= {"dense", "sparse"}:
        raise ContractError(obj, "mlp_layer_types", f"holds {sorted(set(config.mlp_layer_types))}; expected "
                            "'dense' or 'sparse' (MoE) per layer")
    if "sparse" in config.mlp_layer_types and config.num_experts_per_tok > config.num_local_experts:
        raise ContractError(obj, "num_experts_per_token", f"{config.num_experts_per_tok} exceeds num_experts "
                            f"{config.num_local_experts}")
    if config.attention_bias:
        raise ContractError(obj, "attention_bias", "is true; recipe kimi-linear implements projections without bias")


class KimiDeltaAttentionForServing(DeltaRuleForServing):
    """Transformers' KDA layer (its parameters, under their names) over the runtime's state rows."""

    # Where flash-linear-attention is installed, Transformers' decorator swaps these names for its
    # kernels (CUDA only); the CPU reference keeps the torch functions underneath.
    recurrent_rule = staticmethod(inspect.unwrap(kl.recurrent_kimi_delta_attention))
    chunk_rule = staticmethod(inspect.unwrap(kl.chunk_kimi_delta_attention))
    kernel_rule = staticmethod(kimi_delta_rule)

    def __init__(self, original: kl.KimiLinearDeltaAttention):
        super().__init__()
        self.layer_idx, self.activation = original.layer_idx, original.activation
        self.head_k_dim = self.head_v_dim = original.head_dim
        self.key_dim = self.value_dim = original.qkv_dim
        # Every projection of the layer's input read as one matrix (`in_proj_qkvfgb`,
        # flare_core.ops.weights): q, k and v in the order the convolution's channels take them,
        # then the forget gate's f_a, the output gate's g_a and b (at one token eight small
        # matmuls of 0.15-1 MB each were launch-bound: 1.7 TB/s on the H200). The forget gate's
        # f_b follows f_a here; the gate module keeps its bias and decay and, with both factors
        # Identity, computes Transformers' activation of f_b's output (`gates`), which a CUDA
        # decode step leaves to the KDA kernel (`step_in_place`).
        original_gate = original.forget_gate
        self.in_proj_qkvfgb, sizes = fused_linear(original.q_proj, original.k_proj, original.v_proj,
                                                  original_gate.f_a_proj, original.g_a_proj, original.b_proj)
        self.split_sizes = [sum(sizes[:3]), *sizes[3:]]  # q, k and v stay together for the convolution
        self.f_b_proj = original_gate.f_b_proj
        original_gate.f_a_proj = original_gate.f_b_proj = torch.nn.Identity()
        self.conv1d, self.forget_gate = original.conv1d, original_gate
        self.g_b_proj = original.g_b_proj
        self.o_norm, self.o_proj = original.o_norm, original.o_proj

    def project(self, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        mixed, f_a, g_a, b = self.in_proj_qkvfgb(hidden_states).split(self.split_sizes, dim=-1)
        return mixed[0], self.f_b_proj(f_a), b, self.g_b_proj(g_a)

    def gates(self, decay_input: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
        return self.forget_gate(decay_input), torch.sigmoid(b)

    def step_in_place(self, q: Tensor, k: Tensor, v: Tensor, decay_input: Tensor, b: Tensor, state: Tensor,
                      rows: Tensor) -> Tensor:
        tokens = decay_input.shape[1]
        return kimi_delta_rule_step(q, k, v, decay_input.view(1, tokens, -1, self.head_k_dim), b,
                                    self.forget_gate.A_log.view(-1), self.forget_gate.dt_bias, state, rows)

    def output(self, core: Tensor, gate: Tensor) -> Tensor:
        tokens = core.shape[1]
        out = self.o_norm(core, gate.view(1, tokens, -1, self.head_v_dim)).reshape(1, tokens, -1)
        return self.o_proj(out)


def build_model(config: Any, dtype: torch.dtype) -> DecoderForServing:
    """Kimi Linear serving model with parameters on the meta device in `dtype` (the router bias
    in float32, as for DeepSeek-V3)."""
    if config.model_type != "kimi_linear":
        raise ValueError(f"config.model_type: {config.model_type!r} is not kimi_linear")
    with torch.device("meta"):
        causal_lm = kl.KimiLinearForCausalLM(config)
        for layer_idx, layer in enumerate(causal_lm.model.layers):
            if config.layer_types[layer_idx] == LINEAR:
                layer.self_attn = KimiDeltaAttentionForServing(layer.self_attn)
            else:
                layer.self_attn = AbsorbedMLA(layer.self_attn, config, layer_idx, rotary=False)
            serve_sigmoid_moe_mlp(layer, kl.KimiLinearMoE)
    causal_lm.to(dtype)
    keep_router_bias_float32(causal_lm)
    return DecoderForServing(causal_lm, None, bool(config.tie_word_embeddings))


# Kimi Linear checkpoints name the MoE block `block_sparse_moe` (dense layers too) and a routed
# expert's matrices w1 (gate), w3 (up), w2 (down); the forget gate's tensors sit on the attention
# module; q, k and v have one depthwise convolution each (Transformers concatenates them).
_EXPERT_PARTS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_EXPERT = re.compile(r"(.*\.experts\.\d+\.)(gate_proj|up_proj|down_proj)(\.weight)$")


def checkpoint_name(name: str) -> str:
    """The Kimi Linear checkpoint's name of a tensor Transformers' module tree calls `name`."""
    name = name.replace(".mlp.", ".block_sparse_moe.").replace(".self_attn.forget_gate.", ".self_attn.")
    match = _EXPERT.match(name)
    return match[1] + _EXPERT_PARTS[match[2]] + match[3] if match else name


def map_weights(config: Any, checkpoint: Mapping[str, Tensor], dtype: torch.dtype) -> Iterator[tuple[str, Tensor]]:
    """(prepared name, tensor) for every tensor the serving model loads; ValueError naming a
    missing checkpoint tensor."""
    plain = checkpoint_reader(checkpoint)

    def read(name: str, target: str, target_dtype: torch.dtype) -> Tensor:
        return plain(checkpoint_name(name), target, target_dtype)

    def special(name: str, target_dtype: torch.dtype) -> Tensor | None:
        """KDA's q/k/v convolutions as one, and MLA's absorbed up-projections; None for every other tensor."""
        if name.endswith(".self_attn.conv1d.weight"):
            owner = name.removesuffix("conv1d.weight")
            return torch.cat([plain(f"{owner}{part}_conv1d.weight", name, target_dtype) for part in "qkv"])
        return absorbed_mla(name, plain, config, target_dtype)

    yield from prepare_weights(build_model(config, dtype), read, num_experts=config.num_local_experts,
                               special=special)

