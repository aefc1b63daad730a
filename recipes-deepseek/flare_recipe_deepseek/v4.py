"""DeepSeek V4 for serving (the reference path): Transformers' `DeepseekV4ForCausalLM` with its
attention over the runtime's stores.

Transformers' decoder layers, norms, routers (top-k with sqrt-softplus scores and a correction
bias; hash routing by token id in the first layers), experts (SwiGLU clamped at `swiglu_limit`)
and shared experts are reused as they are; the model keeps its `hc_mult` residual streams from
the embedding to the head. Replaced: the mHC sites, by `HyperConnection` (Transformers' module
with its Sinkhorn loop as one op, `flare::sinkhorn`, which compiled code otherwise launches as ~48
kernels a site), and each layer's attention, by `CompressedAttention`, which computes what
`DeepseekV4Attention` does from the runtime's cache instead of Transformers' per-sequence cache:

* every layer: shared-KV multi-query attention (K = V, one head of `head_dim`) over a sliding
  window of `sliding_window` tokens, with a learned sink logit per head, partial interleaved
  rotary on the last `qk_rope_head_dim` channels, undone on the output's rope channels, and the
  grouped low-rank output projection;
* compressed sparse attention (CSA) layers: plus one compressed entry per `compress_rate` tokens
  (softmax-gated pooling of two overlapping windows), of which a lightning indexer picks at most
  `index_topk` per query (its own compressed keys, per-head ReLU scores);
* heavily compressed attention (HCA) layers: plus one compressed entry per `compress_rate`
  tokens (one window each), all of them visible.

The cache scheme (`compressed_attention_scheme`) holds, as data:

* paged stores whose records cover several tokens: "csa_kv" and "csa_index" (one record per
  CSA rate tokens, CSA layers), "hca_kv" (one per HCA rate, HCA layers). Record w of a request
  covers its tokens [w * rate, (w + 1) * rate) and sits in the page holding those tokens, so a
  complete page holds only complete records and is shared through the prefix cache as is;
* continuation state per request row: "window" (the last `sliding_window` K=V rows, a ring
  indexed by position), and the projections of the tokens a compressor has not pooled yet —
  "csa_pending" / "csa_index_pending" (two windows: the open one and, for the overlap, the one
  before it), "hca_pending" (the open window). Rings are indexed by position modulo their length,
  so a snapshot of the rows at any token continues exactly, and a fresh (zeroed) row is the same
  as no history: nothing is read below position 0.

Prepared tensor names are the Transformers names; `map_weights` reads checkpoints named as
DeepSeek publishes them (`layers.N.attn.wq_a.weight`, `embed.weight`, ...) or as Transformers'
`save_pretrained` writes them, through Transformers' own renaming rules for the family.

Prompt chunks run request by request in float32 attention (the reference). A step in which every
request brings one token (decode) runs all requests at once from the batch's device tensors only
(`_decode`: no host reads, shapes fixed by the batch's page table), which a captured graph can
replay; it computes what the per-request path does. On CUDA (a `BatchAttention`: the executor
plans no kernel for it) decode steps replay in captured graphs and prompt chunks run eagerly, in
plain torch: correct, not fast (every step reads all of a request's compressed records; the
indexer's top-k and the sparse attention over it want the field's kernels, #48).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Iterator, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4

from flare_core.api import (
    BatchAttention, CacheScheme, ContractError, DecoderForServing, DequantizedCheckpoint, ForwardContext, Fp8ConfigError,
    PagedStore, StateTensor, fp8_blocks, prepare_weights, sinkhorn, STATIC_ROPE_TYPES, write_paged,
)

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"

# cos, sin [tokens, rope dims / 2] of a rope type ("main" / "compress") at the given positions.
RopeAt = Callable[[Tensor, str], tuple[Tensor, Tensor]]


def layers_of(config: Any, kind: str) -> tuple[int, ...]:
    return tuple(i for i, layer_type in enumerate(config.layer_types) if layer_type == kind)


def compressed_attention_scheme(config: Any, dtype: str) -> CacheScheme:
    """The stores of a DeepSeek V4 model (see the module docstring), in the cache dtype."""
    csa, hca = layers_of(config, CSA), layers_of(config, HCA)
    head_dim, index_dim = config.head_dim, config.index_head_dim
    paged, state = [], [StateTensor("window", (config.sliding_window, head_dim), dtype, config.num_hidden_layers)]
    if csa:
        rate = config.compress_rates[CSA]
        paged += [PagedStore("csa_kv", (head_dim,), dtype, len(csa), tokens_per_record=rate, layer_ids=csa),
                  PagedStore("csa_index", (index_dim,), dtype, len(csa), tokens_per_record=rate, layer_ids=csa)]
        # Each pending row: the token's kv and gate projections side by side (2 x 2 x dim: CSA
        # projects two series, one for its own window and one for the next window's overlap).
        state += [StateTensor("csa_pending", (2 * rate, 4 * head_dim), dtype, len(csa), layer_ids=csa),
                  StateTensor("csa_index_pending", (2 * rate, 4 * index_dim), dtype, len(csa), layer_ids=csa)]
    if hca:
        rate = config.compress_rates[HCA]
        paged.append(PagedStore("hca_kv", (head_dim,), dtype, len(hca), tokens_per_record=rate, layer_ids=hca))
        state.append(StateTensor("hca_pending", (rate, 2 * head_dim), dtype, len(hca), layer_ids=hca))
    return CacheScheme(name="compressed-attention", paged=tuple(paged), state=tuple(state))


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Transformers' V4 rotary (interleaved, on the last rope channels) of x [tokens, heads, dim]
    with cos / sin [tokens, rope dims / 2]."""
    return v4.apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim=1)


def record_slots(page_table: Tensor, records: Tensor, rate: int, page_tokens: int) -> Tensor:
    """Cache indices (page id * records per page + offset) of a request's records `records`
    [N] in a store of one record per `rate` tokens: record w sits in the page of token w * rate."""
    first_tokens = records * rate
    pages = page_table[first_tokens // page_tokens].long()
    return pages * (page_tokens // rate) + (first_tokens % page_tokens) // rate


def read_records(layer_store: Tensor, page_table: Tensor, count: int, rate: int, page_tokens: int) -> Tensor:
    """A request's records 0 .. count - 1 of one paged store layer, [count, *record_shape]."""
    pages = page_table[:-(-count * rate // page_tokens)].long()
    return layer_store[pages].reshape(-1, *layer_store.shape[2:])[:count]


def sliding_keys(kv: Tensor, ring: Tensor, first: int, window: int) -> tuple[Tensor, Tensor]:
    """The window's keys for a request's new K = V rows `kv` (positions first, first + 1, ...): the
    ring's earlier rows, then theirs, and which each query sees (within `window` positions of it,
    not after it). The ring (one layer row, indexed by position modulo its length) takes them."""
    tokens, length = kv.shape[0], ring.shape[0]
    earlier = torch.arange(max(0, first - window + 1), first, device=kv.device)
    keys = torch.cat([ring[earlier % length].to(kv.dtype), kv])
    kept = min(tokens, length)
    ring[torch.arange(first + tokens - kept, first + tokens, device=kv.device) % length] = \
        kv[tokens - kept:].to(ring.dtype)
    key_positions = torch.cat([earlier, torch.arange(first, first + tokens, device=kv.device)])
    query_positions = torch.arange(first, first + tokens, device=kv.device)[:, None]
    return keys, (key_positions <= query_positions) & (key_positions > query_positions - window)


class Compressor:
    """One compressor's pooling over a request's tokens (the CSA / HCA compressor or the CSA
    indexer's): its kv / gate projections are kept per token in a pending ring until a window of
    `rate` tokens closes; then the window becomes one entry, `kv_norm(sum softmax(gate + bias)
    * kv)` rotated at the window's first position. With `overlap` (CSA) the projections are two
    series of `dim` channels: entry w pools the first series of window w - 1 with the second of
    window w (window -1 has weight zero). Computes Transformers' compressor; holds no tensors."""

    def __init__(self, module: nn.Module, rate: int, dim: int, overlap: bool):
        self.module, self.rate, self.dim, self.overlap = module, rate, dim, overlap

    def __call__(self, x: Tensor, pending: Tensor, first: int, rope_at: RopeAt) -> tuple[Tensor, int]:
        """Consume x [n, hidden] (the request's tokens first .. first + n - 1) into `pending` (one
        layer row, in place); return the entries the windows closed by them make and the index
        of the first of them."""
        rate, tokens = self.rate, x.shape[0]
        projected = torch.cat([self.module.kv_proj(x), self.module.gate_proj(x)], dim=-1)
        end = first + tokens
        opened = first // rate  # the window `first` belongs to; windows opened .. end // rate - 1 close
        span_start = max(0, (opened - 1) * rate) if self.overlap else opened * rate
        earlier = torch.arange(span_start, first, device=x.device)
        span = torch.cat([pending[earlier % pending.shape[0]].to(projected.dtype), projected])
        kept = min(tokens, pending.shape[0])
        pending[torch.arange(end - kept, end, device=x.device) % pending.shape[0]] = \
            projected[tokens - kept:].to(pending.dtype)
        closed = end // rate - opened
        if closed == 0:
            return projected.new_zeros(0, self.dim), opened
        width = projected.shape[-1] // 2  # kv | gate
        offset = opened * rate - span_start
        windows = span[offset:offset + closed * rate].view(closed, rate, 2 * width)
        indices = torch.arange(opened, opened + closed, device=x.device)
        before = None
        if self.overlap:
            before = span[max(0, offset - rate):offset + (closed - 1) * rate]
            if opened == 0:  # window -1: no tokens (`_pool` gives it weight zero)
                before = torch.cat([before.new_zeros(rate, 2 * width), before])
            before = before.view(closed, rate, 2 * width)
        return self._pool(windows, before, indices == 0, indices * rate, rope_at), opened

    def decode(self, x: Tensor, pending: Tensor, rows: Tensor, positions: Tensor,
               rope_at: RopeAt) -> tuple[Tensor, Tensor, Tensor]:
        """One new token per request, all requests at once and without reading anything on the
        host (a captured graph's decode step): x [B, hidden] at `positions` [B] into `pending`
        (the layer, [state rows, ring, 2 x width], rows `rows` [B]). Returns the entry of each
        request's current window [B, dim] as if it closed now, whether it does ([B] bool: the token
        is its window's last), and the window's index [B] (its record)."""
        rate, length = self.rate, pending.shape[1]
        projected = torch.cat([self.module.kv_proj(x), self.module.gate_proj(x)], dim=-1)
        pending[rows, positions % length] = projected.to(pending.dtype)
        window = positions // rate
        first = window * rate
        offsets = torch.arange(rate, device=x.device)
        current = pending[rows[:, None], (first[:, None] + offsets) % length].to(projected.dtype)
        before = None
        if self.overlap:  # the window before (none before window 0)
            before = pending[rows[:, None], (first[:, None] - rate + offsets) % length].to(projected.dtype)
        entries = self._pool(current, before, window == 0, first, rope_at)
        return entries, (positions + 1) % rate == 0, window

    def _pool(self, windows: Tensor, before: Tensor | None, no_before: Tensor, first: Tensor,
              rope_at: RopeAt) -> Tensor:
        """The entries [n, dim] of `windows` [n, rate, kv | gate] (with `overlap`, the first series
        of the windows `before` them too, weight zero where `no_before`), rotated at the windows'
        first positions `first` [n]."""
        width = windows.shape[-1] // 2  # kv | gate
        kv, gate = windows[..., :width], windows[..., width:].float() + self.module.position_bias.float()
        if before is not None:
            none = no_before[:, None, None]
            before_kv = before[..., :self.dim].masked_fill(none, 0.0)
            before_gate = (before[..., width:width + self.dim].float()
                           + self.module.position_bias[:, :self.dim].float()).masked_fill(none, float("-inf"))
            kv = torch.cat([before_kv, kv[..., self.dim:]], dim=1)
            gate = torch.cat([before_gate, gate[..., self.dim:]], dim=1)
        pooled = self.module.kv_norm((kv * gate.softmax(dim=1).to(kv.dtype)).sum(dim=1))
        cos, sin = rope_at(first, "compress")
        return rotate(pooled[:, None, :], cos, sin)[:, 0]


def decode_record_slots(page_table: Tensor, records: Tensor, rate: int, page_tokens: int) -> Tensor:
    """`record_slots` of one record per request: record `records[b]` of request b, [B] (the page
    table int64)."""
    first_tokens = records * rate
    pages = page_table.gather(1, (first_tokens // page_tokens)[:, None])[:, 0]
    return pages * (page_tokens // rate) + (first_tokens % page_tokens) // rate


def write_closed(layer_store: Tensor, entries: Tensor, closes: Tensor, slots: Tensor) -> None:
    """Write each request's entry at its record slot where `closes`; elsewhere the record is
    written back as it was (no branch on the host: a captured graph writes every row)."""
    records_per_page = layer_store.shape[1]
    kept = layer_store[slots // records_per_page, slots % records_per_page].to(entries.dtype)
    write_paged(layer_store, torch.where(closes[:, None], entries, kept), slots)


class CompressedAttention(BatchAttention):
    """`DeepseekV4Attention` (its parameters, under their names) over the runtime's stores. Called
    by the Transformers decoder layer with the forward context and the positions in its keyword
    arguments. A `BatchAttention`: on CUDA its decode steps replay in graphs."""

    def __init__(self, original: v4.DeepseekV4Attention, config: Any):
        super().__init__()
        self.layer_idx, self.kind = original.layer_idx, original.layer_type
        self.rope_type = original.rope_layer_type
        self.num_heads, self.head_dim, self.window = original.num_heads, original.head_dim, original.sliding_window
        self.scaling, self.o_groups = original.scaling, config.o_groups
        self.q_a_proj, self.q_a_norm, self.q_b_proj = original.q_a_proj, original.q_a_norm, original.q_b_proj
        self.q_b_norm, self.kv_proj, self.kv_norm = original.q_b_norm, original.kv_proj, original.kv_norm
        self.o_a_proj, self.o_b_proj, self.sinks = original.o_a_proj, original.o_b_proj, original.sinks
        self.compressor = original.compressor
        self.pool = self.index_pool = None
        if self.compressor is not None:
            # The rotations come from the model's rotary module (rope_at); these copies would be
            # buffers on the meta device.
            del self.compressor.rotary_emb
            self.rate = config.compress_rates[self.kind]
            overlap = self.kind == CSA
            self.pool = Compressor(self.compressor, self.rate, self.head_dim, overlap)
            if overlap:
                del self.compressor.indexer.rotary_emb
                self.index_pool = Compressor(self.compressor.indexer, self.rate, config.index_head_dim, True)
                self.index_topk = config.index_topk

    def forward(self, hidden_states: Tensor, position_embeddings: Mapping[str, tuple[Tensor, Tensor]],
                context: ForwardContext, positions: Tensor, rope_at: RopeAt, **_: Any) -> tuple[Tensor, None]:
        x = hidden_states[0]
        tokens = x.shape[0]
        cos, sin = position_embeddings[self.rope_type]
        q_residual = self.q_a_norm(self.q_a_proj(x))
        q = rotate(self.q_b_norm(self.q_b_proj(q_residual).view(tokens, self.num_heads, self.head_dim)), cos, sin)
        kv = rotate(self.kv_norm(self.kv_proj(x))[:, None, :], cos, sin)[:, 0]
        batch = context.batch
        if batch.one_token_each and batch.state_rows is not None:
            out = self._decode(x, q, q_residual, kv, positions, context, rope_at, cos, sin)
        else:
            out = self._per_request(x, q, q_residual, kv, context, rope_at, cos, sin)
        out = rotate(out, cos, -sin)  # K = V: undo the rotation the values carried into the output
        grouped = self.o_a_proj(out.reshape(tokens, self.o_groups, -1)).flatten(1)
        return self.o_b_proj(grouped)[None], None

    def _per_request(self, x: Tensor, q: Tensor, q_residual: Tensor, kv: Tensor, context: ForwardContext,
                     rope_at: RopeAt, cos: Tensor, sin: Tensor) -> Tensor:
        """Attention request by request, from the batch's host copies (prompt chunks; the reference)."""
        batch = context.batch
        out = torch.empty_like(q)
        for r in range(batch.num_requests):
            start, end = batch.query_start_host[r], batch.query_start_host[r + 1]
            first = batch.kv_lens_host[r] - (end - start)
            rows = slice(start, end)
            keys, allowed = sliding_keys(kv[rows], context.store("window", self)[batch.state_rows_host[r]], first,
                                         self.window)
            if self.pool is not None:
                entries, visible = self._compressed(x[rows], q[rows], q_residual[rows], first, r, context, rope_at,
                                                    cos[rows], sin[rows])
                keys, allowed = torch.cat([keys, entries]), torch.cat([allowed, visible], dim=1)
            out[rows] = self._attend(q[rows], keys, allowed)
        return out

    def _decode(self, x: Tensor, q: Tensor, q_residual: Tensor, kv: Tensor, positions: Tensor,
                context: ForwardContext, rope_at: RopeAt, cos: Tensor, sin: Tensor) -> Tensor:
        """Attention of a step in which every request brings one token, computed for all at once
        from the batch's device tensors only (state rows, page table, positions), in shapes the
        batch fixes (its page table's width bounds the records read): what a captured decode graph
        replays. Computes what `_per_request` does."""
        batch = context.batch
        rows = batch.state_rows
        ring = context.store("window", self)
        length = ring.shape[1]
        ring[rows, positions % length] = kv.to(ring.dtype)
        # The window's rows in position order, oldest first; positions below 0 were never written.
        window_positions = positions[:, None] - self.window + 1 + torch.arange(self.window, device=x.device)
        keys = ring[rows[:, None], window_positions % length].to(kv.dtype)
        allowed = window_positions >= 0
        if self.pool is not None:
            entries, visible = self._compressed_decode(x, q_residual, positions, context, rope_at, cos, sin)
            keys, allowed = torch.cat([keys, entries], dim=1), torch.cat([allowed, visible], dim=1)
        return self._attend_rows(q, keys, allowed)

    def _compressed_decode(self, x: Tensor, q_residual: Tensor, positions: Tensor, context: ForwardContext,
                           rope_at: RopeAt, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """`_compressed` for one token per request: each request's window entry written where its
        token closes the window (elsewhere its record is written back unchanged); then the records
        it attends to, [B, K, dim], with which of them it sees: HCA all its pages hold, CSA the
        indexer's top `index_topk` (the indexer reads every key, the attention only those)."""
        batch, rate = context.batch, self.rate
        prefix = "csa" if self.kind == CSA else "hca"
        rows, page_table = batch.state_rows, batch.page_table.long()
        store = context.store(f"{prefix}_kv", self)
        entries, closes, window = self.pool.decode(x, context.store(f"{prefix}_pending", self), rows, positions, rope_at)
        slots = decode_record_slots(page_table, window, rate, batch.page_tokens)
        write_closed(store, entries, closes, slots)
        count = (positions + 1) // rate
        records = page_table.shape[1] * store.shape[1]  # record r of a request: page r // per page, offset r % per page
        visible = torch.arange(records, device=x.device)[None, :] < count[:, None]
        if self.index_pool is None:
            return store[page_table].flatten(1, 2).to(entries.dtype), visible
        index_store = context.store("csa_index", self)
        index_entries, _, _ = self.index_pool.decode(x, context.store("csa_index_pending", self), rows, positions,
                                                     rope_at)
        write_closed(index_store, index_entries, closes, slots)
        index_keys = index_store[page_table].flatten(1, 2).to(index_entries.dtype)
        indexer = self.compressor.indexer
        queries = rotate(indexer.q_b_proj(q_residual).view(x.shape[0], indexer.num_heads, indexer.head_dim), cos, sin)
        scores = indexer.scorer(queries[:, None], index_keys, x[:, None])[:, 0]  # [B, records]
        top = scores.masked_fill(~visible, float("-inf")).topk(min(self.index_topk, records), dim=-1).indices
        # Fewer visible records than the top-k: the rest of it are records not yet written (-inf).
        per_page = store.shape[1]
        chosen = store[page_table.gather(1, top // per_page), top % per_page]
        return chosen.to(entries.dtype), top < count[:, None]

    def _attend_rows(self, q: Tensor, keys: Tensor, allowed: Tensor) -> Tensor:
        """`_attend` for one query per request: q [B, heads, dim] over its keys = values [B, K, dim]
        where `allowed` [B, K]."""
        scores = torch.einsum("bhd,bkd->bhk", q.float(), keys.float()) * self.scaling
        scores = scores.masked_fill(~allowed[:, None], float("-inf"))
        sinks = self.sinks.float()[None, :, None].expand(q.shape[0], -1, 1)
        probs = torch.cat([scores, sinks], dim=-1).softmax(dim=-1)[..., :-1]
        return torch.einsum("bhk,bkd->bhd", probs, keys.float()).to(q.dtype)

    def _compressed(self, x: Tensor, q: Tensor, q_residual: Tensor, first: int, request: int,
                    context: ForwardContext, rope_at: RopeAt, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """This layer's compressed entries of a request (after adding the windows its new tokens
        close) and which each query attends to: entries of windows that end at or before it, all
        of them (HCA) or the indexer's top `index_topk` of them (CSA)."""
        batch, rate = context.batch, self.rate
        row, page_table = batch.state_rows_host[request], batch.page_table[request]
        prefix = "csa" if self.kind == CSA else "hca"
        end = first + x.shape[0]
        count = end // rate
        store = context.store(f"{prefix}_kv", self)
        entries, opened = self.pool(x, context.store(f"{prefix}_pending", self)[row], first, rope_at)
        records = torch.arange(opened, opened + entries.shape[0], device=x.device)
        write_paged(store, entries, record_slots(page_table, records, rate, batch.page_tokens))
        compressed = read_records(store, page_table, count, rate, batch.page_tokens)
        positions = torch.arange(first, end, device=x.device)
        visible = torch.arange(count, device=x.device)[None, :] < ((positions + 1) // rate)[:, None]
        if self.index_pool is None:
            return compressed, visible
        index_store = context.store("csa_index", self)
        index_entries, _ = self.index_pool(x, context.store("csa_index_pending", self)[row], first, rope_at)
        write_paged(index_store, index_entries, record_slots(page_table, records, rate, batch.page_tokens))
        index_keys = read_records(index_store, page_table, count, rate, batch.page_tokens)
        return compressed, visible & self._selected(x, q_residual, index_keys, visible, cos, sin)

    def _selected(self, x: Tensor, q_residual: Tensor, index_keys: Tensor, visible: Tensor, cos: Tensor,
                  sin: Tensor) -> Tensor:
        """The lightning indexer's choice [queries, entries]: per query, the `index_topk` visible
        entries of highest score."""
        indexer = self.compressor.indexer
        count = index_keys.shape[0]
        if count == 0:
            return visible
        queries = indexer.q_b_proj(q_residual).view(x.shape[0], indexer.num_heads, indexer.head_dim)
        queries = rotate(queries, cos, sin)
        scores = indexer.scorer(queries[None], index_keys[None], x[None])[0]  # [queries, entries]
        scores = scores.masked_fill(~visible, float("-inf"))
        top = scores.topk(min(self.index_topk, count), dim=-1).indices
        chosen = torch.zeros_like(visible)
        chosen.scatter_(1, top, True)
        return chosen

    def _attend(self, q: Tensor, keys: Tensor, allowed: Tensor) -> Tensor:
        """Softmax attention of q [n, heads, dim] over keys = values [K, dim] where `allowed`
        [n, K], with each head's sink logit in the denominator; float32."""
        scores = torch.einsum("qhd,kd->hqk", q.float(), keys.float()) * self.scaling
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        sinks = self.sinks.float()[:, None, None].expand(-1, q.shape[0], 1)
        probs = torch.cat([scores, sinks], dim=-1).softmax(dim=-1)[..., :-1]
        return torch.einsum("hqk,kd->qhd", probs, keys.float()).to(q.dtype)


class DeepseekV4ForServing(DecoderForServing):
    """The runtime model protocol over `DeepseekV4ForCausalLM`: the embedding copied into
    `hc_mult` streams, the decoder layers with the token ids (hash routing), both rope types and
    the positions in their keyword arguments, the streams collapsed by `hc_head` before the norm."""

    # Transformers' `DeepseekV4Experts._apply_gate`: SiLU(gate clamped above at `limit`) times up
    # clamped to +-`limit` (the config's swiglu_limit), which flare::routed_experts computes.
    clamped_swiglu_experts = (v4.DeepseekV4Experts,)

    def layer_inputs(self, input_ids: Tensor, positions: Tensor) -> tuple[Tensor, dict[str, Any]]:
        embedded = self.model.embed_tokens(input_ids[None])
        hidden = embedded.unsqueeze(2).expand(-1, -1, self.model.config.hc_mult, -1).contiguous()

        def rope_at(at: Tensor, rope_type: str) -> tuple[Tensor, Tensor]:
            cos, sin = self.model.rotary_emb(embedded, position_ids=at[None], layer_type=rope_type)
            return cos[0], sin[0]

        position_embeddings = {kind: rope_at(positions, kind) for kind in ("main", "compress")}
        return hidden, {"input_ids": input_ids[None], "position_embeddings": position_embeddings,
                        "positions": positions, "rope_at": rope_at}

    def last_rows(self, hidden: Tensor, logits_indices: Tensor) -> Tensor:
        return self.model.hc_head(hidden.index_select(1, logits_indices))[0]


def hyper_mixes(mixed: Tensor, base: Tensor, scale: Tensor, hc: int, iters: int, eps: float
                ) -> tuple[Tensor, Tensor, Tensor]:
    """An mHC site's (pre [..., hc], post [..., hc], comb [..., hc, hc]) from its projection of the
    normalised streams `mixed` [..., (2 + hc) * hc], its bias and its three scales: pre and post
    sigmoids, comb a softmax per row Sinkhorn-projected towards doubly stochastic (`sinkhorn`: one
    op, the reference's loop on the CPU). Transformers' `DeepseekV4HyperConnection` and V4.1's
    sites compute this, in this order."""
    pre = torch.sigmoid(mixed[..., :hc] * scale[0] + base[:hc]) + eps
    post = 2 * torch.sigmoid(mixed[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])
    comb = torch.softmax((mixed[..., 2 * hc:] * scale[2] + base[2 * hc:]).unflatten(-1, (hc, hc)), dim=-1) + eps
    return pre, post, sinkhorn(comb, iters, eps)


class HyperConnection(v4.DeepseekV4HyperConnection):
    """Transformers' mHC site (its parameters, under their names) with its mixes from `hyper_mixes`."""

    def forward(self, hidden_streams: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        mixed = F.linear(self.input_norm(hidden_streams.flatten(2).float()), self.fn.float())
        pre, post, comb = hyper_mixes(mixed, self.base, self.scale, self.hc_mult, self.hc_sinkhorn_iters, self.hc_eps)
        collapsed = (pre.unsqueeze(-1) * hidden_streams).sum(dim=2).to(hidden_streams.dtype)
        return post, comb, collapsed


def keep_float32(causal_lm: nn.Module) -> None:
    """Back to float32 after the cast to the model dtype: the tensors Transformers keeps in float32
    for this family (`_keep_in_fp32_modules_strict`: mHC weights, sinks, pooling biases, norms,
    the router bias), matched by module or tensor name as Transformers matches them."""
    kept = set(type(causal_lm)._keep_in_fp32_modules_strict)
    for module_name, module in causal_lm.named_modules():
        owner = set(module_name.split("."))
        for registry in (module._parameters, module._buffers):
            for name, tensor in registry.items():
                if tensor is not None and tensor.is_floating_point() and (owner | {name}) & kept:
                    value = torch.empty_like(tensor, dtype=torch.float32)
                    registry[name] = nn.Parameter(value, requires_grad=False) if registry is module._parameters \
                        else value


def check_config(config: Any, model_type: str = "deepseek_v4") -> None:
    """ContractError naming the field when the checkpoint's config is one this path (or V4.1's, with
    its `model_type`) cannot serve."""
    if config.model_type != model_type:
        raise ContractError(type(config).__name__, "model_type", f"{config.model_type!r} is not {model_type}")
    for label, parameters in config.rope_parameters.items():
        if not isinstance(parameters, dict):  # flat keys Transformers' rotary adds beside "main" / "compress"
            continue
        rope_type = parameters.get("rope_type", "default")
        if rope_type not in STATIC_ROPE_TYPES:
            raise ContractError(type(config).__name__, f"rope_parameters.{label}.rope_type",
                                f"{rope_type!r} is not supported (supported: {', '.join(STATIC_ROPE_TYPES)})")
    if config.num_key_value_heads != 1:
        raise ContractError(type(config).__name__, "num_key_value_heads",
                            f"must be 1 (shared-KV attention), got {config.num_key_value_heads}")


def build_model(config: Any, dtype: torch.dtype) -> DeepseekV4ForServing:
    """Serving model with parameters on the meta device in `dtype` (Transformers' float32 tensors
    in float32) and the rotary module's buffers on the CPU (flare_core.ops.loading)."""
    check_config(config)
    with torch.device("meta"):
        causal_lm = v4.DeepseekV4ForCausalLM(config)
        for layer in causal_lm.model.layers:
            layer.self_attn = CompressedAttention(layer.self_attn, config)
            layer.attn_hc, layer.ffn_hc = HyperConnection(config), HyperConnection(config)
    causal_lm.to(dtype)
    keep_float32(causal_lm)
    with torch.device("cpu"):
        rotary_emb = v4.DeepseekV4RotaryEmbedding(config)
    return DeepseekV4ForServing(causal_lm, rotary_emb, bool(config.tie_word_embeddings))


# A routed expert's matrices in DeepSeek's checkpoints (V4 and V4.1): w1 (gate), w3 (up), w2 (down),
# under the names of Transformers' per-expert parts.
EXPERT_PARTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def transformers_names(checkpoint_names: Iterator[str]) -> dict[str, str]:
    """Transformers' name (per-expert matrices as w1 / w3 / w2) -> checkpoint name, for checkpoints
    named as DeepSeek publishes them or as `save_pretrained` writes them (which keeps part of
    DeepSeek's naming), by Transformers' own renaming rules for deepseek_v4."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightRenaming

    renamings = [r for r in get_checkpoint_conversion_mapping("deepseek_v4") if isinstance(r, WeightRenaming)]
    names = {}
    for checkpoint_name in checkpoint_names:
        name = checkpoint_name.removeprefix("model.")
        for renaming in renamings:
            name = renaming.rename_source_key(name)[0]
        names[name if name.startswith("lm_head.") else f"model.{name}"] = checkpoint_name
    return names


def checkpoint_names(checkpoint_names: Iterator[str]) -> dict[str, str]:
    """The model-side name of each checkpoint tensor -> its checkpoint name: `transformers_names`,
    each routed expert's matrices under the names of Transformers' per-expert parts (gate_proj,
    up_proj, down_proj for w1, w3, w2), as `map_weights` reads them and tensor parallelism slices
    them (flare_core.parallel)."""
    names = {}
    for name, checkpoint_name in transformers_names(checkpoint_names).items():
        stem, _, leaf = name.removesuffix(".weight").rpartition(".")
        if ".experts." in name and leaf in EXPERT_PARTS:
            name = f"{stem}.{EXPERT_PARTS[leaf]}.weight"
        names[name] = checkpoint_name
    return names


def map_weights(config: Any, checkpoint: Mapping[str, Tensor], dtype: torch.dtype) -> Iterator[tuple[str, Tensor]]:
    """(prepared name, tensor in the model's dtype for it) for every tensor the serving model loads;
    fp8 block-quantized weights dequantized. ValueError naming a missing checkpoint tensor, or the
    config field when its quantization_config is unsupported."""
    try:
        blocks = fp8_blocks(config)
    except Fp8ConfigError as exc:
        raise ValueError(f"config.json {exc}") from exc
    source = DequantizedCheckpoint(checkpoint, blocks)
    names = checkpoint_names(iter(source))

    def read(name: str, target: str, target_dtype: torch.dtype) -> Tensor:
        if name not in names:
            raise ValueError(f"checkpoint lacks the tensor Transformers names {name!r} (needed for prepared "
                             f"tensor {target!r})")
        return source[names[name]].to(target_dtype)

    yield from prepare_weights(build_model(config, dtype), read, num_experts=config.n_routed_experts)


def plan_notes(config: Any) -> tuple[str, ...]:
    """What `flare export` prints about a DeepSeek V4 checkpoint: where it runs, and its weight
    bytes per format with the GPUs that would hold them."""
    weights = build_model(config, torch.bfloat16).state_dict()
    experts = sum(t.numel() for name, t in weights.items() if ".mlp.experts." in name)
    others = sum(t.numel() for t in weights.values()) - experts
    formats = {"bfloat16": 2 * (experts + others), "FP8": experts + others, "FP4 experts + FP8": experts // 2 + others}
    sizes = ", ".join(f"{name} {size / 1e9:.1f} GB" for name, size in formats.items())
    return ("DeepSeek V4 on CUDA: decode steps in captured graphs, prompt chunks eager, its compressed attention "
            "in plain torch (no fast kernels yet); --device cpu serves the reference path",
            f"weights by format: {sizes}; 141 GB H200s needed for the weights alone: "
            + ", ".join(f"{name} {-(-size // 141_000_000_000)}" for name, size in formats.items()),
            "the multi-token-prediction layer (mtp.*) stays in the checkpoint; it is not read")
