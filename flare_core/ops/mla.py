"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over a paged *latent* cache, in the absorbed
form: the cache keeps one compressed record per token, never per-head keys and values.

Per token the model produces a latent `c` [kv_lora_rank] (normalised) and one rotary key part
`k_pe` [rope_dim] shared by all heads. Head h's key and value are linear in the latent,
`k_h = [W_UK_h c ; k_pe]` and `v_h = W_UV_h c` (`W_UK_h` [nope_dim, kv_lora_rank], `W_UV_h`
[v_dim, kv_lora_rank], the per-head blocks of `kv_b_proj`). Moving those matrices to the query
and output sides gives the same attention without expanding the cache:

    score(t, s) = scale * (q_nope_h · W_UK_h c_s + q_pe_h · k_pe_s)
                = scale * ((W_UK_h^T q_nope_h) · c_s + q_pe_h · k_pe_s)
    out_h(t)    = W_UV_h sum_s p(t, s) c_s

So attention runs with a latent query `q_latent_h = W_UK_h^T q_nope_h` [kv_lora_rank] plus the
rotary query `q_pe_h` [rope_dim] against the stored `(c, k_pe)`, and returns the latent output
`sum_s p c_s` [num_heads, kv_lora_rank]; the caller applies `W_UV_h` and the output projection.
This is the computation of FlashInfer's `BatchMLAPagedAttentionWrapper.run(q_nope, q_pe,
ckv_cache, kpe_cache)`, whose two cache inputs are exactly the two paged stores here.

Cache layout (cache scheme "mla-latent", flare_core.plugins.builtin): paged stores "ckv"
(record `[kv_lora_rank]`) and "kpe" (record `[rope_dim]`), one record per token per layer, each
layer a tensor `[num_pages, page_tokens, dim]`.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor, nn

from flare_core.ops.attention import AttentionBatch, ForwardContext, write_paged
from flare_core.ops.opaque import bound_context


class MLABackend(Protocol):
    """A step's planned MLA kernel (the GPU path); called once per layer. `context.attention`
    holds one when the step runs on a kernel backend, None for the plain-torch reference."""

    def run_mla(self, q_latent: Tensor, q_rope: Tensor, ckv_layer: Tensor, kpe_layer: Tensor,
                scale: float) -> Tensor: ...


def mla_attention_reference(q_latent: Tensor, q_rope: Tensor, ckv_layer: Tensor, kpe_layer: Tensor,
                            batch: AttentionBatch, scale: float) -> Tensor:
    """Causal absorbed MLA of each request's new queries over its cached + new latent records.

    q_latent [T, num_heads, kv_lora_rank], q_rope [T, num_heads, rope_dim]; ckv_layer
    [num_pages, page_tokens, kv_lora_rank] and kpe_layer [num_pages, page_tokens, rope_dim]
    already holding this step's records. Computed in float32; returns the latent output
    [T, num_heads, kv_lora_rank] in q_latent's dtype.
    """
    if q_latent.shape[:2] != q_rope.shape[:2]:
        raise ValueError(f"mla_attention_reference: q_latent {tuple(q_latent.shape)} and q_rope "
                         f"{tuple(q_rope.shape)} disagree on tokens or heads")
    out = torch.empty_like(q_latent)
    for b in range(batch.num_requests):
        start, end = batch.query_start_host[b], batch.query_start_host[b + 1]
        kv_len = batch.kv_lens_host[b]
        pages = batch.page_table[b, : -(-kv_len // batch.page_tokens)].long()
        latents = ckv_layer[pages].reshape(-1, ckv_layer.shape[-1])[:kv_len].float()
        rope_keys = kpe_layer[pages].reshape(-1, kpe_layer.shape[-1])[:kv_len].float()
        scores = (torch.einsum("qhr,kr->hqk", q_latent[start:end].float(), latents)
                  + torch.einsum("qhd,kd->hqk", q_rope[start:end].float(), rope_keys)) * scale
        # New token i sits at absolute position kv_len - num_new + i and sees keys up to there.
        query_pos = torch.arange(kv_len - (end - start), kv_len, device=q_latent.device)
        key_pos = torch.arange(kv_len, device=q_latent.device)
        scores = scores.masked_fill(key_pos[None, None, :] > query_pos[None, :, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start:end] = torch.einsum("hqk,kr->qhr", probs, latents).to(q_latent.dtype)
    return out


class MLAPagedAttention(nn.Module):
    """Append this step's latent records to layer `layer_idx` of the "ckv"/"kpe" paged stores,
    then attend in the absorbed form (see the module docstring).

    forward(q_latent [T, num_heads, kv_lora_rank], q_rope [T, num_heads, rope_dim],
    latent [T, kv_lora_rank], k_rope [T, rope_dim], context) -> [T, num_heads, kv_lora_rank].
    Rotary embedding of q_rope and k_rope is the caller's job, done before the call: the cache
    stores rotated rope keys.
    """

    def __init__(self, num_heads: int, kv_lora_rank: int, rope_dim: int, scale: float, layer_idx: int,
                 latent_store: str = "ckv", rope_store: str = "kpe"):
        super().__init__()
        self.num_heads, self.kv_lora_rank, self.rope_dim = num_heads, kv_lora_rank, rope_dim
        self.scale, self.layer_idx = scale, layer_idx
        self.latent_store, self.rope_store = latent_store, rope_store

    def forward(self, q_latent: Tensor, q_rope: Tensor, latent: Tensor, k_rope: Tensor,
                context: ForwardContext) -> Tensor:
        ckv_layer = context.store(self.latent_store, self)
        kpe_layer = context.store(self.rope_store, self)
        if ckv_layer.shape[-1] != self.kv_lora_rank or kpe_layer.shape[-1] != self.rope_dim:
            raise ValueError(f"MLAPagedAttention layer {self.layer_idx}: cache records are "
                             f"{ckv_layer.shape[-1]} + {kpe_layer.shape[-1]} wide, the model needs "
                             f"kv_lora_rank {self.kv_lora_rank} + rope dim {self.rope_dim}")
        write_paged(ckv_layer, latent, context.batch.slot_mapping)
        write_paged(kpe_layer, k_rope, context.batch.slot_mapping)
        if torch.compiler.is_compiling():  # see flare_core.ops.opaque
            return torch.ops.flare.latent_attention(q_latent, q_rope, ckv_layer, kpe_layer, self.scale)
        return attend_latent(q_latent, q_rope, ckv_layer, kpe_layer, self.scale, context)

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, kv_lora_rank={self.kv_lora_rank}, rope_dim={self.rope_dim}, "
                f"layer_idx={self.layer_idx}")


def attend_latent(q_latent: Tensor, q_rope: Tensor, ckv_layer: Tensor, kpe_layer: Tensor, scale: float,
                  context: ForwardContext) -> Tensor:
    """Absorbed MLA over latent cache layers that already hold this step's records: the step's
    planned kernel backend, or the plain-torch reference when it has none."""
    if context.attention is not None:
        return context.attention.run_mla(q_latent, q_rope, ckv_layer, kpe_layer, scale)
    return mla_attention_reference(q_latent, q_rope, ckv_layer, kpe_layer, context.batch, scale)


@torch.library.custom_op("flare::latent_attention", mutates_args=())
def _latent_attention_op(q_latent: Tensor, q_rope: Tensor, ckv_layer: Tensor, kpe_layer: Tensor,
                         scale: float) -> Tensor:
    return attend_latent(q_latent, q_rope, ckv_layer, kpe_layer, scale, bound_context("latent_attention"))


@_latent_attention_op.register_fake
def _(q_latent: Tensor, q_rope: Tensor, ckv_layer: Tensor, kpe_layer: Tensor, scale: float) -> Tensor:
    return torch.empty_like(q_latent)
