"""DeepSeek V4.1 for serving (the reference path), over the runtime's stores. No Transformers
release defines V4.1 yet: the modeling here is Flare's own, written from the definition on
Transformers' main branch (`src/transformers/models/deepseek_v41/modeling_deepseek_v41.py` at
0a2080b43eb64e6d448186a4f3f0bc9c618f4797) and checked against the logits that definition
computes (tests/test_deepseek_v41.py). Transformers' released V4 modules serve where V4.1 is V4:
the RMS norms, the two rotary embeddings ("main", "compress"), the interleaved rotary and the
grouped output projection.

A layer: `hc_mult` residual streams (hyper-connections); at engram layers first the n-gram table
lookup (flare_recipe_deepseek.v41_engram); then attention and the MoE block, each fed by a
collapse of the streams whose weights the previous site computed (single-pass mHC: a site's
`pre` mix is consumed by the next site) and expanded back with Sinkhorn-mixed residuals.

Attention: 64 query heads over one shared K = V latent with a learned sink per head, a sliding
window of `sliding_window` rows (FP8-quantized, v41_quant) and, in layers with a compress ratio
r > 0, the compressed entries of their group (CSA2):

* a KV-source layer (`kv_source_layer_ids`) owns a compressor: every r tokens pool into one
  latent (r = 1: each token is its own) whose rotated, FP4-quantized form is the group's
  compressed entry and whose indexer key (`wk`, `k_norm`, rotated, FP4) the group scores against;
* an index-source layer (`index_source_layer_ids`) scores its queries against those keys (ReLU
  per indexer head, weighted sum) and picks the top `index_topk` visible entries per query; the
  layers after it until the next index source attend to the same picks. The candidate source
  (`candidate_source_layer_id`) also keeps its top `candidate_topk_blocks` blocks of
  `candidate_block_size` entries (the query's newest block always in), within which every later
  index source picks;
* layers with ratio 0 keep the sliding window only.

The cache scheme (`shared_compressed_attention_scheme`), as data:

* paged stores, one pair per compress ratio of the KV sources: "compressed_kv_r{r}" and
  "index_keys_r{r}", one record per r tokens, covering the KV-source layers of that ratio.
  Record w of a request covers its tokens [w * r, (w + 1) * r) and sits in the page of its first
  token, so a complete page holds complete records and is shared through the prefix cache;
* continuation state per request row: "window" (the last `sliding_window` K = V rows, a ring by
  position, every layer), "pending_r{r}" (the kv and gate projections of the tokens of the
  group not closed yet, float32, the KV sources of ratio r > 1) and "ngram_history" (the last
  `engram_max_ngram_size - 1` compressed token ids, at the first engram layer). Rings are indexed
  by position modulo their length and nothing below position 0 is read, so a fresh row is the
  same as no history and a snapshot at any token continues exactly.

Prompt chunks run request by request through attention, in float32, from the batch's host copies
(the reference's order). A step in which every request brings one token (decode) runs all requests
at once from the batch's device tensors only (`Attention._decode`, the n-gram hashes' `decode`, the
experts through the core's routed-experts op), which a captured graph can replay. On CUDA (a
`BatchAttention`: the executor plans no kernel for it) decode steps replay captured graphs and
prompt chunks run eagerly, unless the model has Engram layers: their table rows are read on the
host each step, so every step of such a model runs eagerly. The attention is plain torch (the
field's sparse kernels are #48's).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.activations import ACT2FN
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4

from flare_core.api import (BatchAttention, CacheScheme, ContractError, DecoderForServing, ForwardContext, PagedStore,
                            StateTensor, TableSource, embedding_tables, read_table, routed_experts, table_skeleton,
                            write_paged)
from flare_recipe_deepseek.v4 import check_config as v4_check_config
from flare_recipe_deepseek.v4 import (EXPERT_PARTS, decode_record_slots, hyper_mixes, read_records, record_slots,
                                      rotate, sliding_keys, write_closed)
from flare_recipe_deepseek.v41_engram import Engram, NgramHashes
from flare_recipe_deepseek.v41_quant import fp4_blocks, fp8_blocks


def ratio_stores(config: Any) -> dict[int, tuple[int, ...]]:
    """Compress ratio -> the KV-source layers of that ratio."""
    stores: dict[int, tuple[int, ...]] = {}
    for layer in config.kv_source_layer_ids:
        ratio = config.compress_ratios[layer]
        stores[ratio] = (*stores.get(ratio, ()), layer)
    return stores


def shared_compressed_attention_scheme(config: Any, dtype: str) -> CacheScheme:
    """The stores of a DeepSeek V4.1 model (see the module docstring), in the cache dtype."""
    head_dim, layers = config.head_dim, config.num_hidden_layers
    paged, state = [], [StateTensor("window", (config.sliding_window, head_dim), dtype, layers)]
    for ratio, sources in sorted(ratio_stores(config).items()):
        paged += [PagedStore(f"compressed_kv_r{ratio}", (head_dim,), dtype, len(sources), tokens_per_record=ratio,
                             layer_ids=sources),
                  PagedStore(f"index_keys_r{ratio}", (config.index_head_dim,), dtype, len(sources),
                             tokens_per_record=ratio, layer_ids=sources)]
        if ratio > 1:
            state.append(StateTensor(f"pending_r{ratio}", (ratio, 2 * head_dim), "float32", len(sources),
                                     layer_ids=sources))
    if config.engram_layer_ids:
        state.append(StateTensor("ngram_history", (config.engram_max_ngram_size - 1,), "int64", 1,
                                 layer_ids=(min(config.engram_layer_ids),)))
    return CacheScheme(name="shared-compressed-attention", paged=tuple(paged), state=tuple(state))


@dataclass
class RequestShare:
    """What a request's source layers publish to the layers after them within one step: the
    group's compressed entries and indexer keys (all of the request's, [count, dim]), the picks
    of the last index source [queries, count] and the candidate source's blocks. In a decode
    step one share holds every request's: the keys [B, records, dim] over the records its page
    table bounds (the index sources mask those not written yet by position), the group's entries
    left in their store (`store`, read only where picked) and the picks as record indices `chosen`
    [B, k] with `chosen_valid` [B, k]."""

    entries: Tensor | None = None
    keys: Tensor | None = None
    picks: Tensor | None = None
    candidates: Tensor | None = None
    store: Tensor | None = None
    chosen: Tensor | None = None
    chosen_valid: Tensor | None = None


@dataclass
class Step:
    """One forward's inputs every layer reads, and the state it carries from layer to layer."""

    input_ids: Tensor
    positions: Tensor
    embedded: Tensor  # [tokens, hidden]: the rotations come in its dtype, as the reference's do
    rotary: nn.Module
    pre: Tensor  # [tokens, hc]: the collapse weights the last site computed for the next one
    ngram: NgramHashes | None
    rope: dict[str, tuple[Tensor, Tensor]] = field(default_factory=dict)  # rope type -> cos, sin
    decode: bool = False  # one token per request, computed from the batch's device tensors only
    hashes: Tensor | None = None  # [tokens, engram layers, columns], computed at the first engram layer
    shares: dict[int, RequestShare] = field(default_factory=dict)  # by request; a decode step's under -1

    def rope_at(self, positions: Tensor, rope_type: str) -> tuple[Tensor, Tensor]:
        """cos, sin [n, rope dims / 2] of a rope type at `positions` [n]."""
        cos, sin = self.rotary(self.embedded, position_ids=positions[None], layer_type=rope_type)
        return cos[0], sin[0]


class Float32Linear(nn.Linear):
    """A linear layer the reference computes in float32 whatever the served dtype (a compressor's
    pooling projections). `--quantize fp8` leaves it as it is: it quantizes plain nn.Linear layers."""

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x.float(), self.weight.float())


class Compressor(nn.Module):
    """A KV source's pooling: r tokens into one latent, `norm(sum softmax(gate) * kv)` over the
    group in float32 (r = 1: `norm(wkv(x))`, no gate)."""

    def __init__(self, config: Any, ratio: int):
        super().__init__()
        self.ratio, self.head_dim = ratio, config.head_dim
        linear = Float32Linear if ratio > 1 else nn.Linear
        self.wkv = linear(config.hidden_size, config.head_dim, bias=False)
        self.wgate = Float32Linear(config.hidden_size, config.head_dim, bias=False) if ratio > 1 else None
        self.norm = v4.DeepseekV4RMSNorm(config.head_dim, eps=config.rms_norm_eps)

    def forward(self, x: Tensor, pending: Tensor | None, first: int) -> tuple[Tensor, int]:
        """The pre-rotary latents of the groups the request's tokens first .. first + n - 1 close,
        and the index of the first of them; `pending` (one layer row) keeps the open group."""
        if self.wgate is None:
            return self.norm(self.wkv(x)), first
        ratio, tokens = self.ratio, x.shape[0]
        projected = torch.cat([self.wkv(x), self.wgate(x)], dim=-1)
        opened, end = first // ratio, first + tokens
        span = torch.cat([pending[:first - opened * ratio], projected])  # from the open group's first token
        closed = end // ratio - opened
        tail = span[closed * ratio:]
        pending[:tail.shape[0]] = tail
        if closed == 0:
            return x.new_zeros(0, self.head_dim), opened
        groups = span[:closed * ratio].view(closed, ratio, 2 * self.head_dim)
        return self._pool(groups, x.dtype), opened

    def decode(self, x: Tensor, pending: Tensor | None, rows: Tensor, positions: Tensor) -> Tensor:
        """One new token per request, all at once from device tensors: x [B, hidden] at `positions`
        [B] into `pending` (the layer, [state rows, ratio, 2 x head_dim], rows `rows`). Returns the
        pre-rotary latent [B, head_dim] of each request's open group as if it closed now (it does
        where the token is the group's last; elsewhere the caller keeps the record as it was)."""
        if self.wgate is None:
            return self.norm(self.wkv(x))
        pending[rows, positions % self.ratio] = torch.cat([self.wkv(x), self.wgate(x)], dim=-1)
        # Rows after the token's hold an earlier group's projections: used only where nothing closes.
        return self._pool(pending[rows], x.dtype)

    def _pool(self, groups: Tensor, dtype: torch.dtype) -> Tensor:
        """The latents [n, head_dim] of groups [n, ratio, kv | gate] (float32)."""
        kv, gate = groups[..., :self.head_dim], groups[..., self.head_dim:]
        latent = (kv * gate.softmax(dim=1, dtype=torch.float32)).sum(dim=1)
        return self.norm(latent.to(dtype))


class Indexer(nn.Module):
    """An index source's scoring of its queries against the group's indexer keys."""

    def __init__(self, config: Any, layer_idx: int, owns_keys: bool):
        super().__init__()
        self.ratio = config.compress_ratios[layer_idx]
        self.is_candidate_source = layer_idx == config.candidate_source_layer_id
        self.uses_candidates = 0 <= config.candidate_source_layer_id < layer_idx
        self.candidate_blocks, self.block_size = config.candidate_topk_blocks, config.candidate_block_size
        self.num_heads, self.head_dim, self.topk = config.index_n_heads, config.index_head_dim, config.index_topk
        self.wq_b = nn.Linear(config.q_lora_rank, self.num_heads * self.head_dim, bias=False)
        self.weights_proj = nn.Linear(config.hidden_size, self.num_heads, bias=False)
        if owns_keys:
            self.wk = nn.Linear(config.head_dim, self.head_dim, bias=False)
            self.k_norm = v4.DeepseekV4RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def keys(self, latent: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """The indexer keys of pre-rotary latents [groups, head_dim] at their groups' positions."""
        return fp4_blocks(rotate(self.k_norm(self.wk(latent))[:, None], cos, sin)[:, 0], 32)

    def pick(self, x: Tensor, q_residual: Tensor, keys: Tensor, positions: Tensor, cos: Tensor, sin: Tensor,
             share: RequestShare) -> None:
        """Publish the request's picks [queries, entries] (and at the candidate source its blocks)."""
        tokens = x.shape[0]
        q = rotate(self.wq_b(q_residual).view(tokens, self.num_heads, self.head_dim), cos, sin)
        q = fp4_blocks(q, 32)
        scores = torch.einsum("bshd,btd->bsht", q[None].float(), keys[None].float()).relu_() * self.head_dim ** -0.5
        weights = self.weights_proj(x[None]).float() * self.num_heads ** -0.5
        scores = (scores * weights.unsqueeze(-1)).sum(dim=2)[0]  # [tokens, entries], in the reference's shapes
        self._choose(scores, positions, share)

    def pick_rows(self, x: Tensor, q_residual: Tensor, positions: Tensor, cos: Tensor, sin: Tensor,
                  share: RequestShare) -> None:
        """`pick` for a decode step: one query per request [B] against its group's keys [B, records,
        dim] (`share.keys`); the picks [B, records]."""
        assert share.keys is not None
        tokens = x.shape[0]
        q = fp4_blocks(rotate(self.wq_b(q_residual).view(tokens, self.num_heads, self.head_dim), cos, sin), 32)
        scores = torch.einsum("bhd,brd->bhr", q.float(), share.keys.float()).relu_() * self.head_dim ** -0.5
        weights = self.weights_proj(x).float() * self.num_heads ** -0.5
        self._choose((scores * weights.unsqueeze(-1)).sum(dim=1), positions, share)

    def _choose(self, scores: Tensor, positions: Tensor, share: RequestShare) -> None:
        """The picks of queries at `positions` [n] from their scores [n, entries]."""
        count = scores.shape[-1]
        visible_count = ((positions + 1) // self.ratio)[:, None]  # entries whose group the query has passed
        scores = scores.masked_fill(torch.arange(count, device=scores.device)[None] >= visible_count, float("-inf"))
        if self.is_candidate_source:
            share.candidates = self._blocks(scores, visible_count)
        elif self.uses_candidates and share.candidates is not None:
            scores = scores.masked_fill(~share.candidates, float("-inf"))
        top = scores.topk(min(self.topk, count), dim=-1, sorted=False)
        share.chosen, share.chosen_valid = top.indices, top.values > float("-inf")
        share.picks = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, share.chosen, share.chosen_valid)

    def _blocks(self, scores: Tensor, visible_count: Tensor) -> Tensor:
        """The candidate blocks [queries, entries]: per query the `candidate_blocks` blocks of
        highest best score, the block of its newest visible entry always among them."""
        count, size = scores.shape[-1], self.block_size
        blocks = F.pad(scores, (0, -count % size), value=float("-inf")).unflatten(-1, (-1, size)).amax(-1)
        newest = (visible_count - 1) // size
        blocks = blocks.masked_fill(torch.arange(blocks.shape[-1], device=scores.device)[None] == newest, torch.inf)
        top = blocks.topk(min(self.candidate_blocks, blocks.shape[-1]), dim=-1)
        kept = torch.zeros_like(blocks, dtype=torch.bool).scatter_(-1, top.indices, top.values > float("-inf"))
        return kept.repeat_interleave(size, dim=-1)[:, :count]


class Attention(BatchAttention):
    """V4.1's attention (module docstring) over the runtime's stores, its parameters under the
    reference's names. Prompt chunks request by request from the batch's host copies (bit for bit
    the reference's order); a decode step (one token per request) for all requests at once from
    the batch's device tensors only (`_decode`), which a captured graph can replay."""

    def __init__(self, config: Any, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.ratio = config.compress_ratios[layer_idx]
        self.rope_type = "compress" if self.ratio else "main"
        self.num_heads, self.head_dim, self.window = config.num_attention_heads, config.head_dim, config.sliding_window
        self.o_groups = config.o_groups
        self.wq_a = nn.Linear(config.hidden_size, config.q_lora_rank, bias=False)
        self.q_norm = v4.DeepseekV4RMSNorm(config.q_lora_rank, eps=config.rms_norm_eps)
        self.wq_b = nn.Linear(config.q_lora_rank, self.num_heads * self.head_dim, bias=False)
        self.wkv = nn.Linear(config.hidden_size, self.head_dim, bias=False)
        self.kv_norm = v4.DeepseekV4RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.wo_a = v4.DeepseekV4GroupedLinear(self.num_heads * self.head_dim // config.o_groups,
                                               config.o_groups * config.o_lora_rank, config.o_groups)
        self.wo_b = nn.Linear(config.o_groups * config.o_lora_rank, config.hidden_size, bias=False)
        self.attn_sink = nn.Parameter(torch.empty(self.num_heads))
        self.is_kv_source = layer_idx in config.kv_source_layer_ids
        self.compressor = Compressor(config, self.ratio) if self.is_kv_source else None
        is_index_source = layer_idx in config.index_source_layer_ids
        self.indexer = Indexer(config, layer_idx, self.is_kv_source) if is_index_source else None

    def forward(self, x: Tensor, step: Step, context: ForwardContext) -> Tensor:
        tokens = x.shape[0]
        cos, sin = step.rope[self.rope_type]
        q_residual = self.q_norm(self.wq_a(x))
        q = rotate(self.wq_b(q_residual).view(tokens, self.num_heads, self.head_dim), cos, sin)
        kv = fp8_blocks(rotate(self.kv_norm(self.wkv(x))[:, None], cos, sin)[:, 0], 32)
        if step.decode:
            out = self._decode(x, q, q_residual, kv, step, context, cos, sin)
        else:
            out = self._per_request(x, q, q_residual, kv, step, context, cos, sin)
        out = rotate(out, cos, -sin)  # K = V: undo the rotation the values carried into the output
        return self.wo_b(self.wo_a(out.reshape(tokens, self.o_groups, -1)).flatten(1))

    def _per_request(self, x: Tensor, q: Tensor, q_residual: Tensor, kv: Tensor, step: Step, context: ForwardContext,
                     cos: Tensor, sin: Tensor) -> Tensor:
        """The attention request by request, from the batch's host copies (the reference's order)."""
        batch = context.batch
        out = torch.empty_like(q)
        for r in range(len(batch.query_start_host) - 1):
            start, end = batch.query_start_host[r], batch.query_start_host[r + 1]
            first = batch.kv_lens_host[r] - (end - start)
            rows = slice(start, end)
            keys, allowed = sliding_keys(kv[rows], context.store("window", self)[batch.state_rows_host[r]], first,
                                         self.window)
            if self.ratio:
                share = step.shares.setdefault(r, RequestShare())
                if self.is_kv_source:
                    self._publish(x[rows], first, r, context, step, share)
                if self.indexer is not None and share.keys is not None:
                    self.indexer.pick(x[rows], q_residual[rows], share.keys, step.positions[rows], cos[rows],
                                      sin[rows], share)
                if share.entries is not None:
                    picks = share.picks if share.picks is not None else \
                        torch.zeros(end - start, share.entries.shape[0], dtype=torch.bool, device=x.device)
                    keys, allowed = torch.cat([keys, share.entries]), torch.cat([allowed, picks], dim=1)
            out[rows] = self._attend(q[rows], keys, allowed)
        return out

    def _publish(self, x: Tensor, first: int, request: int, context: ForwardContext, step: Step,
                 share: RequestShare) -> None:
        """A KV source: pool the groups the request's new tokens close, store their entries and
        indexer keys, and publish all of the request's to its group."""
        batch, ratio = context.batch, self.ratio
        row, page_table = batch.state_rows_host[request], batch.page_table[request]
        pending = context.store(f"pending_r{ratio}", self)[row] if ratio > 1 else None
        latent, opened = self.compressor(x, pending, first)
        count = (first + x.shape[0]) // ratio
        records = torch.arange(opened, opened + latent.shape[0], device=x.device)
        entries_store, keys_store = context.store(f"compressed_kv_r{ratio}", self), context.store(
            f"index_keys_r{ratio}", self)
        if latent.shape[0]:
            slots = record_slots(page_table, records, ratio, batch.page_tokens)
            cos, sin = step.rope_at(records * ratio, "compress")
            if self.indexer is not None:
                write_paged(keys_store, self.indexer.keys(latent, cos, sin), slots)
            write_paged(entries_store, fp4_blocks(rotate(latent[:, None], cos, sin)[:, 0], 16, e4m3_scales=True),
                        slots)
        share.entries = read_records(entries_store, page_table, count, ratio, batch.page_tokens)
        share.keys = (read_records(keys_store, page_table, count, ratio, batch.page_tokens)
                      if self.indexer is not None and count else None)
        share.picks = None  # a new group: the picks of an earlier group's index source do not apply

    def _decode(self, x: Tensor, q: Tensor, q_residual: Tensor, kv: Tensor, step: Step, context: ForwardContext,
                cos: Tensor, sin: Tensor) -> Tensor:
        """The attention of a decode step, every request at once from the batch's device tensors
        (state rows, page table, positions), in shapes the batch fixes (its page table's width
        bounds the indexer keys scored; of the entries only the picked ones are read): what the
        request-by-request path computes, in another order."""
        rows, positions = context.batch.state_rows, step.positions
        ring = context.store("window", self)
        length = ring.shape[1]
        ring[rows, positions % length] = kv.to(ring.dtype)
        # The window's rows in position order, oldest first; positions below 0 were never written.
        window_positions = positions[:, None] - self.window + 1 + torch.arange(self.window, device=x.device)
        keys, allowed = ring[rows[:, None], window_positions % length].to(kv.dtype), window_positions >= 0
        if self.ratio:
            share = step.shares.setdefault(-1, RequestShare())
            if self.is_kv_source:
                self._publish_rows(x, step, context, share)
            if self.indexer is not None and share.keys is not None:
                self.indexer.pick_rows(x, q_residual, positions, cos, sin, share)
            if share.store is not None and share.chosen is not None:  # no picks yet: the window alone
                page_table, per_page = context.batch.page_table.long(), share.store.shape[1]
                chosen = share.store[page_table.gather(1, share.chosen // per_page), share.chosen % per_page]
                keys = torch.cat([keys, chosen.to(keys.dtype)], dim=1)
                allowed = torch.cat([allowed, share.chosen_valid], dim=1)
        return self._attend_rows(q, keys, allowed)

    def _publish_rows(self, x: Tensor, step: Step, context: ForwardContext, share: RequestShare) -> None:
        """`_publish` for a decode step: each request's group entry (and indexer key) written where
        its token closes the group (elsewhere the record is written back as it was); the group's
        indexer keys, [B, records, dim] (record r: page r // per page, offset r % per page), and its
        entries' store."""
        batch, ratio = context.batch, self.ratio
        rows, positions, page_table = batch.state_rows, step.positions, batch.page_table.long()
        pending = context.store(f"pending_r{ratio}", self) if ratio > 1 else None
        latent = self.compressor.decode(x, pending, rows, positions)
        records, closes = positions // ratio, (positions + 1) % ratio == 0
        slots = decode_record_slots(page_table, records, ratio, batch.page_tokens)
        entries_store, keys_store = context.store(f"compressed_kv_r{ratio}", self), context.store(
            f"index_keys_r{ratio}", self)
        cos, sin = step.rope_at(records * ratio, "compress")
        if self.indexer is not None:
            write_closed(keys_store, self.indexer.keys(latent, cos, sin), closes, slots)
        write_closed(entries_store, fp4_blocks(rotate(latent[:, None], cos, sin)[:, 0], 16, e4m3_scales=True), closes,
                     slots)
        share.store = entries_store  # its entries are read where picked (`_decode`), not all of them
        share.keys = keys_store[page_table].flatten(1, 2) if self.indexer is not None else None
        share.picks = share.chosen = None  # a new group: an earlier group's picks do not apply

    def _attend_rows(self, q: Tensor, keys: Tensor, allowed: Tensor) -> Tensor:
        """`_attend` for one query per request: q [B, heads, dim] over its keys = values [B, K, dim]
        where `allowed` [B, K]."""
        keys = keys.to(q.dtype)
        mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill_(~allowed, float("-inf"))
        scores = torch.einsum("bhd,bkd->bhk", q, keys) * self.head_dim ** -0.5 + mask[:, None]
        sinks = self.attn_sink.float()[None, :, None].expand(q.shape[0], -1, 1)
        combined = torch.cat([scores, sinks], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = F.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1].to(keys.dtype)
        return torch.einsum("bhk,bkd->bhd", probs, keys)

    def _attend(self, q: Tensor, keys: Tensor, allowed: Tensor) -> Tensor:
        """Softmax attention of q [n, heads, dim] over keys = values [K, dim] where `allowed`
        [n, K], with each head's sink logit in the denominator. The reference's operations in its
        order and shapes (its quantizers make the model sensitive to the last bit: a different
        summation order can move a value across a rounding boundary)."""
        keys = keys.to(q.dtype)[None, None]  # [1, 1, K, dim]: one K = V head for all query heads
        mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill_(~allowed, float("-inf"))
        scores = torch.matmul(q.transpose(0, 1)[None], keys.transpose(2, 3)) * self.head_dim ** -0.5 + mask
        sinks = self.attn_sink.reshape(1, -1, 1, 1).expand(1, -1, q.shape[0], 1).float()
        combined = torch.cat([scores, sinks], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = F.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1].to(keys.dtype)
        return torch.matmul(probs, keys)[0].transpose(0, 1)


class Experts(nn.Module):
    """The routed experts, packed: `gate_up_proj` [E, 2I, hidden] (w1 rows, then w3), `down_proj`
    [E, hidden, I]; SiLU-gated with the up branch clamped to +-swiglu_limit and the gate from
    above, each token's output times its route weight. Computed by the core's routed-experts op
    (no host sync), which reads the tensors as the core keeps them: FP4 groups as DeepSeek
    publishes its experts, FP8 blocks, or the served dtype."""

    def __init__(self, config: Any, experts: int):
        super().__init__()
        inter, hidden = config.moe_intermediate_size, config.hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, inter))
        self.limit = float(config.swiglu_limit)

    def forward(self, x: Tensor, weights: Tensor, ids: Tensor) -> Tensor:
        """x [T, hidden], route weights and expert ids [T, k] -> [T, hidden] float32."""
        return routed_experts(self, x, ids, weights, self.limit).sum(dim=1)


class MoE(nn.Module):
    """Routed experts (scores `scoring_func(logits / gate_temp)` in float32, chosen by score +
    bias, weighted by the unbiased scores, normalized, times `routed_scaling_factor`) plus one
    shared expert."""

    def __init__(self, config: Any):
        super().__init__()
        self.gate = nn.Module()
        self.gate.weight = nn.Parameter(torch.empty(config.n_routed_experts, config.hidden_size))
        self.gate.bias = nn.Parameter(torch.empty(config.n_routed_experts, dtype=torch.float32))
        self.top_k, self.temperature = config.num_experts_per_tok, config.gate_temp
        self.normalize, self.scale = config.norm_topk_prob, config.routed_scaling_factor
        self.score = ACT2FN[config.scoring_func]
        self.experts = Experts(config, config.n_routed_experts)
        self.shared_experts = Experts(config, 1)

    def forward(self, x: Tensor) -> Tensor:
        scores = self.score(F.linear(x.float(), self.gate.weight.float()) / self.temperature)
        ids = (scores + self.gate.bias).topk(self.top_k, dim=-1)[1]
        weights = scores.gather(1, ids)
        if self.normalize and self.top_k > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        out = self.experts(x, weights * self.scale, ids)
        always = torch.zeros_like(ids[:, :1])  # the shared expert: expert 0 of its own, weight 1
        out += self.shared_experts(x, torch.ones_like(weights[:, :1]), always)
        return out.to(x.dtype)


class DecoderLayer(nn.Module):
    """A V4.1 block over `hc_mult` residual streams (module docstring)."""

    def __init__(self, config: Any, layer_idx: int):
        super().__init__()
        self.layer_idx, self.hc = layer_idx, config.hc_mult
        self.sinkhorn_iters, self.hc_eps = config.hc_sinkhorn_iters, config.hc_eps
        self.hc_input_norm = v4.DeepseekV4UnweightedRMSNorm(eps=config.rms_norm_eps)
        self.attn = Attention(config, layer_idx)
        self.ffn = MoE(config)
        self.attn_norm = v4.DeepseekV4RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.ffn_norm = v4.DeepseekV4RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.engram = Engram(config, layer_idx) if layer_idx in config.engram_layer_ids else None
        self.first_engram = bool(config.engram_layer_ids) and layer_idx == min(config.engram_layer_ids)
        mixes, width = (2 + self.hc) * self.hc, self.hc * config.hidden_size
        for site in ("attn", "ffn"):
            setattr(self, f"hc_{site}_fn", nn.Parameter(torch.empty(mixes, width, dtype=torch.float32)))
            setattr(self, f"hc_{site}_base", nn.Parameter(torch.empty(mixes, dtype=torch.float32)))
            setattr(self, f"hc_{site}_scale", nn.Parameter(torch.empty(3, dtype=torch.float32)))

    def mixes(self, streams: Tensor, site: str) -> tuple[Tensor, Tensor, Tensor]:
        """(pre, post, comb) of a site from one projection of the normalized flattened streams;
        comb Sinkhorn-projected towards doubly stochastic."""
        fn, base, scale = (getattr(self, f"hc_{site}_{part}").float() for part in ("fn", "base", "scale"))
        mixed = F.linear(self.hc_input_norm(streams.flatten(start_dim=-2).float()), fn)
        return hyper_mixes(mixed, base, scale, self.hc, self.sinkhorn_iters, self.hc_eps)

    @staticmethod
    def collapse(streams: Tensor, pre: Tensor) -> Tensor:
        return (pre.unsqueeze(-1) * streams.float()).sum(dim=-2).to(streams.dtype)

    @staticmethod
    def expand(x: Tensor, residual: Tensor, post: Tensor, comb: Tensor) -> Tensor:
        mixed = torch.einsum("tjk,tjd->tkd", comb.float(), residual.float())
        return (post.unsqueeze(-1) * x.float().unsqueeze(-2) + mixed).to(residual.dtype)

    def forward(self, streams: Tensor, step: Step, context: ForwardContext) -> Tensor:
        """streams [tokens, hc, hidden] -> the same after this block; updates `step.pre`."""
        if self.engram is not None:
            if context.staged_tables:  # rows staged before the step (DeepseekV41ForServing.stage_tables)
                streams = self.engram(streams, None)
            else:
                if self.first_engram:
                    step.hashes = self._hashes(step, context)
                streams = self.engram(streams, step.hashes[:, self.engram.table_index])
        attn_pre, post, comb = self.mixes(streams, "attn")
        x = self.attn(self.attn_norm(self.collapse(streams, step.pre)), step, context)
        streams = self.expand(x, streams, post, comb)
        ffn_pre, post, comb = self.mixes(streams, "ffn")
        x = self.ffn(self.ffn_norm(self.collapse(streams, attn_pre)))
        step.pre = ffn_pre
        return self.expand(x, streams, post, comb)

    def _hashes(self, step: Step, context: ForwardContext) -> Tensor:
        batch, history = context.batch, context.store("ngram_history", self)
        if step.decode:
            return step.ngram.decode(step.input_ids, history, batch.state_rows, step.positions)
        hashes = []
        for r in range(len(batch.query_start_host) - 1):
            start, end = batch.query_start_host[r], batch.query_start_host[r + 1]
            first = batch.kv_lens_host[r] - (end - start)
            hashes.append(step.ngram(step.input_ids[start:end], history[batch.state_rows_host[r]], first))
        return torch.cat(hashes)


class Model(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = v4.DeepseekV4RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.ngram = NgramHashes(config) if config.engram_layer_ids else None
        self.rotary_emb: nn.Module | None = None


class DeepseekV41ForServing(DecoderForServing):
    """The runtime model protocol over V4.1: the embedding copied into `hc_mult` streams, the layers
    with a per-step `Step`, the streams collapsed by the last site's mix before the norm."""

    def __init__(self, config: Any, rotary_emb: nn.Module):
        causal_lm = nn.Module()
        causal_lm.model = Model(config)
        causal_lm.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        super().__init__(causal_lm, rotary_emb, tie_word_embeddings=False)
        # Its experts modules run the core's routed-experts op: `--quantize fp8` keeps their tensors
        # packed (FP4 groups as published, else FP8 blocks), and the op reads them so.
        self.fused_experts = True

    def run(self, input_ids: Tensor, positions: Tensor, context: ForwardContext, groups: list[nn.Module] | None,
            logits: Any) -> Tensor:
        model = self.model
        embedded = model.embed(input_ids)
        streams = embedded.unsqueeze(1).expand(-1, model.config.hc_mult, -1).contiguous()
        pre = torch.zeros(streams.shape[:-1], dtype=torch.float32, device=streams.device)
        pre[:, 0] = 1.0  # the first site collapses stream 0
        batch = context.batch
        step = Step(input_ids, positions, embedded, model.rotary_emb, pre, model.ngram,
                    decode=batch.one_token_each and batch.state_rows is not None)
        step.rope = {kind: step.rope_at(positions, kind) for kind in ("main", "compress")}
        if groups is None:
            for index, layer in enumerate(model.layers):
                streams = layer(streams, step, context.for_layer(index))
        else:  # CompiledDecoder's layer groups: each layer called with the step record as its argument
            first = 0
            for group in groups:
                contexts = tuple(context.for_layer(first + i) for i in range(len(group.layers)))
                streams = group(streams, {"step": step}, contexts)
                first += len(group.layers)
        return logits(DecoderLayer.collapse(streams, step.pre)[None], context.batch.logits_indices)

    def stage_tables(self, input_ids: Tensor, positions: Tensor, context: ForwardContext) -> None:
        """Before a captured decode step (flare_core.api.TableRows): its n-gram hashes, each
        request's history row taking the new token as the step's first Engram layer would, and
        every Engram layer's rows gathered into its table's staging buffer. The step then runs with
        `context.staged_tables` and computes no hash."""
        layers = self.model.layers
        first = next(layer for layer in layers if layer.first_engram)
        hashes = self.model.ngram.decode(input_ids, context.store("ngram_history", first), context.batch.state_rows,
                                         positions)
        for layer in layers:
            if layer.engram is not None:
                layer.engram.embed.stage(hashes[:, layer.engram.table_index])


def check_config(config: Any) -> None:
    """ContractError naming the field when the checkpoint's config is one this path cannot serve."""
    v4_check_config(config, "deepseek_v41_text")
    if config.hidden_act != "silu":  # the experts' gate (the routed-experts op computes SiLU)
        raise ContractError(type(config).__name__, "hidden_act",
                            f"{config.hidden_act!r} is not supported (supported: silu)")


# The float32 tensors of the reference (`_keep_in_fp32_modules_strict`): mHC weights, sinks, router bias.
_FLOAT32 = re.compile(r"\.(hc_(attn|ffn)_(fn|base|scale)|attn_sink|gate\.bias)$")


def build_model(config: Any, dtype: torch.dtype) -> DeepseekV41ForServing:
    """Serving model with parameters on the meta device in `dtype` (the reference's float32 tensors
    in float32) and the rotary module's and hash tables' buffers on the CPU."""
    check_config(config)
    with torch.device("cpu"):
        rotary_emb = v4.DeepseekV4RotaryEmbedding(config)
    with torch.device("meta"):
        model = DeepseekV41ForServing(config, rotary_emb)
    for name, parameter in list(model.named_parameters()):
        target = torch.float32 if _FLOAT32.search(name) else dtype
        module_name, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(module_name), leaf,
                nn.Parameter(torch.empty_like(parameter, dtype=target), requires_grad=False))
    for table in embedding_tables(model).values():
        table.row_dtype = dtype
    return model


_EXPERT = re.compile(r"(.*\.ffn)\.(experts|shared_experts)\.(gate_up_proj|down_proj)$")
_ROUTED = re.compile(r"(.*\.ffn\.experts\.\d+)\.(w[123])\.weight$")


def checkpoint_names(names: Iterator[str]) -> dict[str, str]:
    """The model-side name of each checkpoint tensor -> its checkpoint name, for tensor
    parallelism to slice what `map_weights` reads: Transformers' names (DeepSeek's gain `model.`,
    its `head.weight` is `lm_head.weight`), each routed expert's `w1` / `w3` / `w2` under its part's
    name. The shared expert keeps its names (the recipe's TensorParallelSpec derives it)."""
    model_side = {}
    for name in names:
        ours = "lm_head.weight" if name == "head.weight" else name if name.startswith(("model.", "lm_head.")) \
            else f"model.{name}"
        routed = _ROUTED.match(ours)
        if routed is not None:
            ours = f"{routed[1]}.{EXPERT_PARTS[routed[2]]}.weight"
        model_side[ours] = name
    return model_side


def map_weights(config: Any, checkpoint: Mapping[str, Tensor],
                dtype: torch.dtype) -> Iterator[tuple[str, Tensor | TableSource]]:
    """(prepared name, tensor) for every tensor the serving model loads, from a checkpoint named as
    Transformers' V4.1 names it (`model.layers.N.attn.wq_a.weight`, per-expert `w1` / `w2` / `w3`) or
    as DeepSeek does (`layers.N.attn.wq_a.weight`, `embed.weight`, `head.weight`), dequantized by
    export (flare_core.prepare.fp8_checkpoint: FP8 32 x 32 blocks, FP4 experts, FP8 Engram rows);
    the routed and shared experts packed; the Engram tables as TableSources, read block by block.
    ValueError naming a missing checkpoint tensor."""
    def stored(name: str, target: str) -> str:
        # Transformers' name, or DeepSeek's (no `model.` prefix, the head as `head.weight`).
        published = "head.weight" if name == "lm_head.weight" else name.removeprefix("model.")
        for candidate in (name, published):
            if candidate in checkpoint:
                return candidate
        raise ValueError(f"checkpoint lacks tensor {name!r} or {published!r} (needed for prepared tensor {target!r})")

    def read(name: str, target: str) -> Tensor:
        return checkpoint[stored(name, target)]

    model = build_model(config, dtype)
    for name in table_skeleton(model):  # the Engram tables, read block by block (~384 M rows each)
        yield name, read_table(checkpoint, stored(name, name), dtype)
    for name, tensor in model.state_dict().items():
        expert = _EXPERT.match(name)
        if name == "model.ngram.token_map":
            continue  # from the tokenizer (v41_engram.compressed_token_map), not the checkpoint
        if expert is None:
            yield name, read(name, name).to(tensor.dtype)
            continue
        ffn, kind, part = expert.groups()
        prefix = [f"{ffn}.experts.{e}" for e in range(tensor.shape[0])] if kind == "experts" else [f"{ffn}.shared_experts"]
        leaves = ("w1", "w3") if part == "gate_up_proj" else ("w2",)
        # Filled expert by expert in the served dtype: export then holds the packed tensor and one
        # dequantized float32 expert, not every expert in float32 twice over.
        packed = torch.empty(tensor.shape, dtype=tensor.dtype)
        for e, p in enumerate(prefix):
            row = 0
            for leaf in leaves:
                part_weight = read(f"{p}.{leaf}.weight", name)
                packed[e, row:row + part_weight.shape[0]] = part_weight
                row += part_weight.shape[0]
        yield name, packed
