"""Paged attention over the runtime's KV cache: the batch description, the forward context a
model receives, and the plain-torch reference implementation.

A step processes a *flattened ragged batch*: the new tokens of B requests laid back to back
(T tokens in all). Request b owns rows `query_start[b]:query_start[b+1]`; after this step it has
`kv_lens[b]` tokens in the cache (its cached tokens plus the new ones), stored in the pages
`page_table[b, :ceil(kv_lens[b] / page_tokens)]`. Each new token's K/V record goes to cache index
`slot_mapping[t] = page_id * page_tokens + offset` (FlashInfer's and vLLM's name for the list).

Cache layout: a paged store layer is a tensor `[num_pages, page_tokens // tokens_per_record,
*record_shape]`; for the "k" and "v" stores of the "attention-kv" scheme that is
`[num_pages, page_tokens, kv_heads, head_dim]` (FlashInfer's NHD layout).

`PagedAttention` is the one module every standard-attention recipe uses; the GPU path swaps the
reference computation for FlashInfer behind the same interface.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Mapping, Protocol, Sequence

import torch
from torch import Tensor, nn

from flare_core.kernels.fp8 import FP8_MAX
from flare_core.kernels.transfer import to_device
from flare_core.ops.opaque import bound_context


def cache_index(pages: Sequence[int], position: int, page_tokens: int) -> int:
    """The cache index of the token at `position` of a request whose pages are `pages`."""
    return pages[position // page_tokens] * page_tokens + position % page_tokens


# Tokens per chunk of the chunked linear-attention kernels (flash-linear-attention's chunk size
# for the gated delta rules).
LINEAR_CHUNK_TOKENS = 64


def linear_chunks(lengths: Sequence[int]) -> list[tuple[int, int]]:
    """(request, chunk) of each LINEAR_CHUNK_TOKENS-token chunk of requests with `lengths` new
    tokens, in order: `AttentionBatch.chunk_indices` on the host."""
    return [(b, c) for b, n in enumerate(lengths) for c in range(-(-n // LINEAR_CHUNK_TOKENS))]


@dataclass(frozen=True, eq=False)
class AttentionBatch:
    """Where each request's new tokens sit in the flattened batch and in the paged cache.

    Device tensors: `query_start` int32 [B+1], `kv_lens` int32 [B], `page_table` int32
    [B, max_pages] (unused entries are 0), `slot_mapping` int64 [T], `logits_indices` int64 [R].
    `query_start_host` / `kv_lens_host` repeat the first two on the host so the reference path
    never waits on the device.
    """

    query_start: Tensor
    kv_lens: Tensor
    page_table: Tensor
    slot_mapping: Tensor
    logits_indices: Tensor
    page_tokens: int
    query_start_host: tuple[int, ...]
    kv_lens_host: tuple[int, ...]
    # Each request's continuation-state row (schemes with state tensors; empty / None otherwise):
    # where its recurrent layers read and write their state. The device copy (int64 [B]) is what
    # kernels and captured graphs read; a decode graph's rows come from its inputs each replay.
    state_rows_host: tuple[int, ...] = ()
    state_rows: Tensor | None = None
    # For a step of state rows in which some request brings several tokens: (request, chunk) of
    # each LINEAR_CHUNK_TOKENS-token chunk of every request's new tokens, int64 [chunks, 2], the
    # index chunked linear-attention kernels read. Built here on the host once per step: derived
    # from `query_start` on the device, each recurrent layer would wait for the device to learn
    # the number of chunks.
    chunk_indices: Tensor | None = None
    # Whether every request brings exactly one new token (a decode step). Stored, not derived from
    # the host tuples: compiled layers that branch on it then guard on this flag, not on the
    # request count (which made Dynamo compile them again for each decode graph's batch size).
    one_token_each: bool = False

    @property
    def num_requests(self) -> int:
        return len(self.kv_lens_host)

    @property
    def num_tokens(self) -> int:
        return self.query_start_host[-1]

    def positions(self) -> Tensor:
        """Absolute position of every new token (int64 [T]), on the batch's device."""
        spans = []
        for b in range(self.num_requests):
            new = self.query_start_host[b + 1] - self.query_start_host[b]
            spans.append(torch.arange(self.kv_lens_host[b] - new, self.kv_lens_host[b], dtype=torch.int64))
        return to_device(torch.cat(spans), torch.int64, self.slot_mapping.device)

    @classmethod
    def build(cls, sequences: Sequence[tuple[int, int, Sequence[int]]], page_tokens: int,
              device: torch.device | str, every_row: Sequence[bool] = (),
              state_rows: Sequence[int] = ()) -> AttentionBatch:
        """Describe a step from `(num_new_tokens, num_cached_before, page_ids)` per request.

        `page_ids` lists the request's pages in order and must cover all its tokens after the
        step. Logits are produced for each request's last new token, and for every new token of
        the requests `every_row` flags (prompt scoring). `state_rows`: each request's
        continuation-state row, when the cache scheme has state tensors.
        """
        if state_rows and len(state_rows) != len(sequences):
            raise ValueError(f"AttentionBatch.build: {len(state_rows)} state rows for {len(sequences)} requests")
        if not sequences:
            raise ValueError("AttentionBatch.build: sequences is empty; a step needs at least one request")
        if page_tokens <= 0:
            raise ValueError(f"AttentionBatch.build: page_tokens must be positive, got {page_tokens}")
        query_start, kv_lens, indices, logits_rows = [0], [], [], []
        max_pages = max(len(pages) for _, _, pages in sequences)
        page_table = torch.zeros(len(sequences), max(max_pages, 1), dtype=torch.int32)
        for b, (num_new, num_cached, pages) in enumerate(sequences):
            if num_new <= 0 or num_cached < 0:
                raise ValueError(f"AttentionBatch.build: request {b} has {num_new} new and {num_cached} cached "
                                 "tokens; new tokens must be positive and cached tokens non-negative")
            total = num_cached + num_new
            needed = -(-total // page_tokens)
            if len(pages) < needed:
                raise ValueError(f"AttentionBatch.build: request {b} holds {total} tokens, which needs {needed} "
                                 f"pages of {page_tokens} tokens, but only {len(pages)} page ids were given")
            page_table[b, :len(pages)] = torch.tensor(list(pages), dtype=torch.int32)
            for position in range(num_cached, total):
                indices.append(cache_index(pages, position, page_tokens))
            query_start.append(query_start[-1] + num_new)
            kv_lens.append(total)
            if b < len(every_row) and every_row[b]:
                logits_rows.extend(range(query_start[-2], query_start[-1]))
            else:
                logits_rows.append(query_start[-1] - 1)
        device = torch.device(device)
        lengths = [end - start for start, end in zip(query_start, query_start[1:])]
        chunks = linear_chunks(lengths) if state_rows and max(lengths) > 1 else None
        return cls(
            query_start=to_device(query_start, torch.int32, device),
            kv_lens=to_device(kv_lens, torch.int32, device),
            page_table=to_device(page_table, torch.int32, device),
            slot_mapping=to_device(indices, torch.int64, device),
            logits_indices=to_device(logits_rows, torch.int64, device),
            page_tokens=page_tokens,
            query_start_host=tuple(query_start),
            kv_lens_host=tuple(kv_lens),
            state_rows_host=tuple(state_rows),
            state_rows=to_device(list(state_rows), torch.int64, device) if state_rows else None,
            chunk_indices=to_device(chunks, torch.int64, device) if chunks else None,
            one_token_each=max(lengths) == 1,
        )


@dataclass(frozen=True, eq=False)
class ForwardContext:
    """What a model needs besides token ids and positions for one step: the batch layout and
    the cache, as paged store name -> per-layer tensor (see the module docstring for layouts).
    `attention` is the planned kernel backend for this step (flare_core.kernels.flashinfer_attention);
    None means the plain-torch reference.

    `layer` holds one layer's tensors (store name -> tensor) in the context a decoder loop hands
    to that layer (`for_layer`): compiled layers then find their cache without indexing by their
    layer number, which torch.compile would bake into each layer's code (one compilation per
    layer instead of one shared by all).

    `layer_map` (`CacheScheme.layer_map`): for the stores that cover only some model layers,
    model layer -> the store's own layer index; a layer a store does not cover has none of it.

    `staged_tables`: the step's embedding-table rows were staged before it (a captured decode
    step, flare_core.ops.tables): the model reads them from its tables' staging buffers."""

    batch: AttentionBatch
    cache: Mapping[str, Sequence[Tensor]]
    attention: "AttentionBackend | None" = None
    layer: Mapping[str, Tensor] | None = None
    layer_map: Mapping[str, Mapping[int, int]] = field(default_factory=dict)
    staged_tables: bool = False

    def for_layer(self, index: int) -> ForwardContext:
        own = {name: self._own_layer(name, index) for name in self.cache}
        return replace(self, layer={name: self.cache[name][i] for name, i in own.items() if i is not None})

    def store(self, name: str, module: nn.Module) -> Tensor:
        """The layer of store `name` (paged or state) that `module` (with a `layer_idx`: the model
        layer) reads and writes."""
        if self.layer is not None:
            return self.layer[name]
        own = self._own_layer(name, module.layer_idx)
        if own is None:
            raise KeyError(f"store {name!r} does not cover model layer {module.layer_idx}")
        return self.cache[name][own]

    def _own_layer(self, name: str, index: int) -> int | None:
        covered = self.layer_map.get(name)
        return index if covered is None else covered.get(index)


class AttentionBackend(Protocol):
    """A step's attention, planned on the host before the step runs; called once per layer."""

    def run(self, q: Tensor, k_layer: Tensor, v_layer: Tensor, scale: float) -> Tensor: ...


def write_paged(layer_store: Tensor, records: Tensor, slot_mapping: Tensor) -> None:
    """Write `records` [N, *record_shape] into one layer of a paged store at cache indices
    `slot_mapping` [N] (page_id * records_per_page + offset), in place."""
    # Indexed by (page, offset) on the layer itself, not through a flat view of it: traced by
    # torch.compile (torch 2.11, CUDA), a write into a view of the cache became a copy of the
    # whole layer every step (measured: 10.4 ms per step on 20,000 pages), a write into the
    # layer a scatter of just the new records (0.64 ms).
    records_per_page = layer_store.shape[1]
    if layer_store.dtype == torch.float8_e4m3fn:
        # An FP8 store holds records at scale 1 (no calibrated scales): beyond +-448 a cast would
        # give NaN, so records saturate there.
        records = records.clamp(-FP8_MAX, FP8_MAX)
    layer_store.index_put_((slot_mapping // records_per_page, slot_mapping % records_per_page),
                           records.to(layer_store.dtype))


def paged_attention_reference(q: Tensor, k_layer: Tensor, v_layer: Tensor, batch: AttentionBatch,
                              scale: float) -> Tensor:
    """Causal attention of each request's new queries over its cached + new keys.

    q [T, num_heads, head_dim]; k_layer / v_layer [num_pages, page_tokens, kv_heads, head_dim]
    already holding this step's records. Query head h reads KV head h // (num_heads / kv_heads).
    Computed in float32; returns [T, num_heads, head_dim] in q's dtype.
    """
    num_heads, kv_heads = q.shape[1], k_layer.shape[2]
    if num_heads % kv_heads != 0:
        raise ValueError(f"paged_attention_reference: {num_heads} query heads are not a multiple of "
                         f"{kv_heads} KV heads")
    group = num_heads // kv_heads
    out = torch.empty_like(q)
    for b in range(batch.num_requests):
        start, end = batch.query_start_host[b], batch.query_start_host[b + 1]
        kv_len = batch.kv_lens_host[b]
        pages = batch.page_table[b, : -(-kv_len // batch.page_tokens)].long()
        keys = k_layer[pages].reshape(-1, kv_heads, k_layer.shape[-1])[:kv_len].float()
        values = v_layer[pages].reshape(-1, kv_heads, v_layer.shape[-1])[:kv_len].float()
        keys = keys.repeat_interleave(group, dim=1)  # [kv_len, num_heads, head_dim]
        values = values.repeat_interleave(group, dim=1)
        queries = q[start:end].float()
        scores = torch.einsum("qhd,khd->hqk", queries, keys) * scale
        # New token i sits at absolute position kv_len - num_new + i and sees keys up to there.
        query_pos = torch.arange(kv_len - (end - start), kv_len, device=q.device)
        key_pos = torch.arange(kv_len, device=q.device)
        scores = scores.masked_fill(key_pos[None, None, :] > query_pos[None, :, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, values).to(q.dtype)
    return out


class BatchAttention(nn.Module):
    """Base of attention layers that compute from the forward context alone (the batch's page
    table, state rows and the stores), with kernels of their own or plain torch, and plan nothing
    with the executor (DeepSeek V4's compressed attention). On CUDA their steps run eagerly, and
    their decode steps replay in graphs when computed from the batch's device tensors only: there
    a decode graph's page table is an input, each row's pages written in before every replay
    (flare_core.executor.backends). A subclass whose decode steps read the batch's host copies
    sets `graph_decode` False: then every step of its model runs eagerly, as it does for a model
    that reads embedding tables (their rows are read on the host, flare_core.ops.tables) and does
    not stage them before a captured step (`stage_tables`)."""

    graph_decode: bool = True


class PagedAttention(nn.Module):
    """Append this step's K/V to layer `layer_idx` of the "k"/"v" paged stores, then attend.

    forward(q [T, num_heads, head_dim], k [T, num_kv_heads, head_dim], v [same], context)
    -> [T, num_heads, head_dim]. Position encoding is the caller's job (applied to q and k first).
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, layer_idx: int,
                 key_store: str = "k", value_store: str = "v"):
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"PagedAttention: num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale, self.layer_idx = scale, layer_idx
        self.key_store, self.value_store = key_store, value_store

    def forward(self, q: Tensor, k: Tensor, v: Tensor, context: ForwardContext) -> Tensor:
        k_layer = context.store(self.key_store, self)
        v_layer = context.store(self.value_store, self)
        write_paged(k_layer, k, context.batch.slot_mapping)
        write_paged(v_layer, v, context.batch.slot_mapping)
        if torch.compiler.is_compiling():  # see flare_core.ops.opaque
            return torch.ops.flare.paged_attention(q, k_layer, v_layer, self.scale)
        return attend(q, k_layer, v_layer, self.scale, context)

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"layer_idx={self.layer_idx}")


def attend(q: Tensor, k_layer: Tensor, v_layer: Tensor, scale: float, context: ForwardContext) -> Tensor:
    """Attention of this step's queries over cache layers that already hold its records: the
    step's planned kernel backend, or the plain-torch reference when it has none."""
    if context.attention is not None:
        return context.attention.run(q, k_layer, v_layer, scale)
    return paged_attention_reference(q, k_layer, v_layer, context.batch, scale)


@torch.library.custom_op("flare::paged_attention", mutates_args=())
def _paged_attention_op(q: Tensor, k_layer: Tensor, v_layer: Tensor, scale: float) -> Tensor:
    return attend(q, k_layer, v_layer, scale, bound_context("paged_attention"))


@_paged_attention_op.register_fake
def _(q: Tensor, k_layer: Tensor, v_layer: Tensor, scale: float) -> Tensor:
    return torch.empty_like(q)
