"""Paged attention over the runtime's KV cache: the batch description, the forward context a
model receives, and the plain-torch reference implementation.

A step processes a *flattened ragged batch*: the new tokens of B requests laid back to back
(T tokens in all). Request b owns rows `query_start[b]:query_start[b+1]`; after this step it has
`kv_lens[b]` tokens in the cache (its cached tokens plus the new ones), stored in the pages
`page_table[b, :ceil(kv_lens[b] / page_tokens)]`. Each new token's K/V record goes to slot
`slot_mapping[t] = page_id * page_tokens + offset`.

Cache layout: a paged store layer is a tensor `[num_pages, page_tokens // tokens_per_record,
*record_shape]`; for the "k" and "v" stores of the "attention-kv" scheme that is
`[num_pages, page_tokens, kv_heads, head_dim]` (FlashInfer's NHD layout).

`PagedAttention` is the one module every standard-attention recipe uses; the GPU path swaps the
reference computation for FlashInfer behind the same interface.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Protocol, Sequence

import torch
from torch import Tensor, nn

from flare_core.ops.transfer import to_device


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
              device: torch.device | str) -> AttentionBatch:
        """Describe a step from `(num_new_tokens, num_cached_before, page_ids)` per request.

        `page_ids` lists the request's pages in order and must cover all its tokens after the
        step. Logits are produced for each request's last new token.
        """
        if not sequences:
            raise ValueError("AttentionBatch.build: sequences is empty; a step needs at least one request")
        if page_tokens <= 0:
            raise ValueError(f"AttentionBatch.build: page_tokens must be positive, got {page_tokens}")
        query_start, kv_lens, slots, logits_rows = [0], [], [], []
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
                slots.append(pages[position // page_tokens] * page_tokens + position % page_tokens)
            query_start.append(query_start[-1] + num_new)
            kv_lens.append(total)
            logits_rows.append(query_start[-1] - 1)
        device = torch.device(device)
        return cls(
            query_start=to_device(query_start, torch.int32, device),
            kv_lens=to_device(kv_lens, torch.int32, device),
            page_table=to_device(page_table, torch.int32, device),
            slot_mapping=to_device(slots, torch.int64, device),
            logits_indices=to_device(logits_rows, torch.int64, device),
            page_tokens=page_tokens,
            query_start_host=tuple(query_start),
            kv_lens_host=tuple(kv_lens),
        )


@dataclass(frozen=True, eq=False)
class ForwardContext:
    """What a model needs besides token ids and positions for one step: the batch layout and
    the cache, as paged store name -> per-layer tensor (see the module docstring for layouts).
    `attention` is the planned kernel backend for this step (flare_core.ops.flashinfer_attention);
    None means the plain-torch reference."""

    batch: AttentionBatch
    cache: Mapping[str, Sequence[Tensor]]
    attention: "AttentionBackend | None" = None


class AttentionBackend(Protocol):
    """A step's attention, planned on the host before the step runs; called once per layer."""

    def run(self, q: Tensor, k_layer: Tensor, v_layer: Tensor, scale: float) -> Tensor: ...


def write_paged(layer_store: Tensor, records: Tensor, slot_mapping: Tensor) -> None:
    """Write `records` [N, *record_shape] into one layer of a paged store at record slots
    `slot_mapping` [N] (page_id * records_per_page + offset), in place."""
    flat = layer_store.view(-1, *layer_store.shape[2:])
    flat.index_copy_(0, slot_mapping, records.to(flat.dtype))


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
        return _append_and_attend(self, q, k, v, context)

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"layer_idx={self.layer_idx}")


# Opaque to torch.compile: the cache writes mutate a small slice of a large cache tensor in place
# (traced, they could become a copy of the whole layer) and the kernel backends are Python
# wrappers around FlashInfer launches. The compiled graphs end before and resume after this call.
@torch.compiler.disable
def _append_and_attend(module: PagedAttention, q: Tensor, k: Tensor, v: Tensor, context: ForwardContext) -> Tensor:
    k_layer = context.cache[module.key_store][module.layer_idx]
    v_layer = context.cache[module.value_store][module.layer_idx]
    write_paged(k_layer, k, context.batch.slot_mapping)
    write_paged(v_layer, v, context.batch.slot_mapping)
    if context.attention is not None:
        return context.attention.run(q, k_layer, v_layer, module.scale)
    return paged_attention_reference(q, k_layer, v_layer, context.batch, module.scale)
