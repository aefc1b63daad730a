"""The DeepSeek-V3 architecture (DeepSeek-V3, V3-0324, V3.1, Kimi K2) for serving, built from the
Transformers `DeepseekV3ForCausalLM`.

The Transformers model is built on the meta device from the config; its embeddings, decoder
layers, RMSNorms, rotary embedding (YaRN included: Transformers folds YaRN's mscale into cos/sin
and into the softmax scale) and MoE blocks (shared + routed experts) are reused unchanged.
Replaced:

* attention -> `AbsorbedMLA`: the same q / kv_a projections and norms, then absorbed multi-head
  latent attention over the paged latent cache (flare_core.ops.mla, cache scheme "mla-latent");
* dense MLPs (the first `first_k_dense_replace` layers and each MoE block's shared experts) ->
  flare_core.ops.mlp.FusedGatedMLP with one `gate_up_proj`;
* each MoE block's router -> flare_core.ops.routing.SigmoidTopKRouter (the same routing, as a
  logits matmul and one kernel; same weight and bias).

Absorption. `kv_b_proj` [H * (nope + v), kv_lora_rank] holds, per head h, `W_UK_h` [nope,
kv_lora_rank] (rows 0..nope) and `W_UV_h` [v, kv_lora_rank] (the next v rows). Transformers
expands every cached latent into per-head keys `W_UK_h c` and values `W_UV_h c`; here the latent
stays compressed and the matrices move to the query and output sides (equal up to float
rounding, since q·(W c) = (W^T q)·c):

    q_latent[t, h] = q_nope[t, h] @ w_uk[h]          w_uk = W_UK as [H, nope, kv_lora_rank]
    o_latent[t, h] = sum_s p[t, h, s] * c[s]          (flare_core.ops.mla)
    out[t, h]      = o_latent[t, h] @ w_uv[h]         w_uv = W_UV^T as [H, kv_lora_rank, v]
    output         = o_proj(out[t].flatten())

Prepared tensor names are the Transformers names, except:
* `self_attn.w_uk` [H, qk_nope_head_dim, kv_lora_rank] and `self_attn.w_uv` [H, kv_lora_rank,
  v_head_dim] in place of `self_attn.kv_b_proj.weight`;
* `mlp.gate_up_proj.weight` / `mlp.shared_experts.gate_up_proj.weight` in place of gate + up;
* `mlp.experts.gate_up_proj` [E, 2I, hidden] and `mlp.experts.down_proj` [E, hidden, I], the
  Transformers packed-expert parameters.
The router's `e_score_correction_bias` stays float32 whatever the model dtype, as Transformers
keeps it (`_keep_in_fp32_modules_strict`): expert choice compares biased sigmoid scores.
Keeping W_UK and W_UV apart from q_b_proj / o_proj (rather than folding them in) is deliberate:
folded matrices would cost kv_lora_rank / nope (4x for DeepSeek-V3) the multiply-adds per token.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

from flare_core.ops.attention import ForwardContext
from flare_core.ops.mla import MLAPagedAttention
from flare_core.ops.mlp import FusedGatedMLP
from flare_core.ops.model import DecoderForServing
from flare_core.ops.routing import SigmoidTopKRouter


class AbsorbedMLA(nn.Module):
    """DeepSeek-V3 multi-head latent attention over the paged latent cache. Called by the
    Transformers decoder layer, which passes the forward context through its keyword arguments."""

    def __init__(self, original: ds.DeepseekV3Attention, config: Any, layer_idx: int, rotary: bool = True):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.nope_dim, self.rope_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_dim, self.kv_lora_rank = config.v_head_dim, config.kv_lora_rank
        # q: one projection, or the q_a -> RMSNorm -> q_b low-rank path when q_lora_rank is set.
        self.q_proj = original.q_proj
        self.q_a_proj = original.q_a_proj
        self.q_a_layernorm = original.q_a_layernorm
        self.q_b_proj = original.q_b_proj
        self.kv_a_proj_with_mqa = original.kv_a_proj_with_mqa
        self.kv_a_layernorm = original.kv_a_layernorm
        self.o_proj = original.o_proj
        self.w_uk = nn.Parameter(torch.empty(self.num_heads, self.nope_dim, self.kv_lora_rank))
        self.w_uv = nn.Parameter(torch.empty(self.num_heads, self.kv_lora_rank, self.v_dim))
        # rotary=False: no position encoding at all (Kimi Linear's MLA layers keep the shared key
        # part, unrotated).
        self.rotate = None if not rotary else \
            ds.apply_rotary_pos_emb_interleave if config.rope_interleave else ds.apply_rotary_pos_emb
        # original.scaling is Transformers' softmax scale, YaRN mscale included.
        self.attn = MLAPagedAttention(self.num_heads, self.kv_lora_rank, self.rope_dim, original.scaling, layer_idx)

    def forward(self, hidden_states: Tensor, position_embeddings: tuple[Tensor, Tensor] | None,
                context: ForwardContext, **_: Any) -> tuple[Tensor, None]:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        tokens = x.shape[0]
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rope = q.view(tokens, self.num_heads, -1).split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        k_rope = k_rope[:, None, :]
        if self.rotate is not None:
            cos, sin = position_embeddings
            q_rope, k_rope = self.rotate(q_rope, k_rope, cos, sin, unsqueeze_dim=1)
        q_latent = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)
        out_latent = self.attn(q_latent, q_rope, latent, k_rope[:, 0, :], context)
        out = torch.bmm(out_latent.transpose(0, 1), self.w_uv).transpose(0, 1)
        return self.o_proj(out.reshape(tokens, -1)).reshape(shape), None


def keep_router_bias_float32(causal_lm: nn.Module) -> None:
    """The MoE routers' score correction bias (DeepSeek-V3's, Kimi's) back in float32 after the
    model was cast to its dtype: the routers add it to float32 scores."""
    for module in causal_lm.modules():
        bias = getattr(module, "e_score_correction_bias", None)
        if isinstance(bias, Tensor):
            module.e_score_correction_bias = torch.empty_like(bias, dtype=torch.float32)


def build_model(config: Any, dtype: torch.dtype) -> DecoderForServing:
    """Serving model with parameters on the meta device in `dtype` (the router bias in float32)
    and the rotary embedding's buffers built on the CPU (see flare_core.ops.loading)."""
    if not isinstance(config, ds.DeepseekV3Config):
        raise ValueError(f"config: {type(config).__name__} (model_type {config.model_type!r}) is not a "
                         "DeepseekV3Config")
    with torch.device("meta"):
        causal_lm = ds.DeepseekV3ForCausalLM(config)
        for layer_idx, layer in enumerate(causal_lm.model.layers):
            layer.self_attn = AbsorbedMLA(layer.self_attn, config, layer_idx)
            if isinstance(layer.mlp, ds.DeepseekV3MoE):
                layer.mlp.shared_experts = FusedGatedMLP.like(layer.mlp.shared_experts)
                layer.mlp.gate = SigmoidTopKRouter.like(layer.mlp.gate)
            else:
                layer.mlp = FusedGatedMLP.like(layer.mlp)
    causal_lm.to(dtype)
    keep_router_bias_float32(causal_lm)
    with torch.device("cpu"):
        rotary_emb = ds.DeepseekV3RotaryEmbedding(config)
    return DecoderForServing(causal_lm, rotary_emb, bool(config.tie_word_embeddings))
