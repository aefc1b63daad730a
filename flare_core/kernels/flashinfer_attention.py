"""Paged attention through FlashInfer on the GPU (the plain-torch reference is in
flare_core.ops.attention; both read the same [num_pages, page_tokens, kv_heads, head_dim] pages).

Plans are made on the host from CPU metadata (page tables, lengths the scheduler knows) before
the step runs; only buffer contents change between CUDA graph replays. Decode uses the
tensor-core decode kernel; prefill chunks (and decode mixed into them) use the paged prefill
kernel with a causal mask.

Pages may be float8_e4m3fn (`flare export --kv-dtype fp8_e4m3`) under 16-bit queries
(`cache_dtype` differs from `dtype`): FlashInfer then runs its FA2 kernels, which widen the FP8
records as they load them (its FA3 kernels take FP8 pages only with FP8 queries). Records are
stored at scale 1 (flare_core.ops.attention.write_paged), so no k / v scale is passed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from flare_core.kernels.transfer import to_device

WORKSPACE_BYTES = 256 * 2**20


@dataclass(frozen=True)
class PagedLayout:
    """Host description of a step's requests in FlashInfer's CSR page format."""

    indptr: Tensor          # int32 [B+1]: page counts, cumulative
    indices: Tensor         # int32 [sum pages]: page ids, request after request
    last_page_len: Tensor   # int32 [B]: tokens in each request's last page
    qo_indptr: Tensor       # int32 [B+1]: new tokens, cumulative
    kv_lens: Tensor         # int32 [B]: tokens in the cache after the step (MLA plans take these)

    @classmethod
    def from_requests(cls, kv_lens: Sequence[int], new_tokens: Sequence[int], page_tables: Sequence[Sequence[int]],
                      page_tokens: int) -> PagedLayout:
        indptr, indices, last, qo = [0], [], [], [0]
        kv_lens = list(kv_lens)
        for kv_len, new, pages in zip(kv_lens, new_tokens, page_tables):
            count = -(-kv_len // page_tokens)
            indices.extend(pages[:count])
            indptr.append(indptr[-1] + count)
            last.append(kv_len - (count - 1) * page_tokens)
            qo.append(qo[-1] + new)
        as_int = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
        return cls(as_int(indptr), as_int(indices), as_int(last), as_int(qo), as_int(kv_lens))


class FlashInferDecode:
    """Batch decode (one new token per request) for a fixed batch capacity, usable inside a CUDA
    graph: the page-table buffers are allocated once for up to `max_pages` pages."""

    def __init__(self, workspace: Tensor, capacity: int, max_pages: int, *, num_heads: int, num_kv_heads: int,
                 head_dim: int, page_tokens: int, dtype: torch.dtype, use_cuda_graph: bool,
                 use_tensor_cores: bool = True, split_pages: int | None = None, cache_dtype: torch.dtype | None = None):
        import flashinfer

        device = workspace.device
        self.capacity = capacity
        self._split_pages = split_pages  # KV pages per split-KV chunk; None: FlashInfer's planner decides
        self._shape = (num_heads, num_kv_heads, head_dim, page_tokens)
        self._dtype, self._cache_dtype = dtype, cache_dtype or dtype
        self._indptr = torch.zeros(capacity + 1, dtype=torch.int32, device=device)
        self._indices = torch.zeros(max_pages, dtype=torch.int32, device=device)
        self._last = torch.zeros(capacity, dtype=torch.int32, device=device)
        self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "NHD", use_cuda_graph=use_cuda_graph, use_tensor_cores=use_tensor_cores,
            paged_kv_indptr_buffer=self._indptr, paged_kv_indices_buffer=self._indices,
            paged_kv_last_page_len_buffer=self._last)
        # Split-KV stays on under graphs: in CUDA-graph mode FlashInfer's planner always splits
        # (the captured grid holds the attention and merge kernels, sized for the capacity) and
        # only the chunk size and work lists in its buffers change per plan. Without the split,
        # one request's decode runs on as many CTAs as it has KV heads, and reads a long context
        # at a fraction of the bandwidth (measured on the H200: 23 us per layer at 1k tokens).

    def plan(self, layout: PagedLayout, scale: float) -> None:
        num_heads, num_kv_heads, head_dim, page_tokens = self._shape
        # Page ids go up asynchronously first: the wrapper copies host indices with a blocking copy,
        # which would make the host wait for the steps still running.
        indices = to_device(layout.indices, torch.int32, self._indptr.device)
        self.wrapper.plan(layout.indptr, indices, layout.last_page_len, num_heads, num_kv_heads, head_dim,
                          page_tokens, q_data_type=self._dtype, kv_data_type=self._cache_dtype, sm_scale=scale,
                          non_blocking=True, fixed_split_size=self._split_pages)

    def run(self, q: Tensor, k_layer: Tensor, v_layer: Tensor, scale: float) -> Tensor:
        return self.wrapper.run(q, (k_layer, v_layer))


class FlashInferPrefill:
    """Ragged batch of prompt chunks (and single decode tokens) over the paged cache, causal.

    With `graph=(requests, max_pages)` the wrapper runs in FlashInfer's CUDA-graph mode for a
    graph of a fixed token capacity: every plan has exactly `requests` requests (the executor
    pads with empty ones) and the same total token count, over at most `max_pages` pages, and
    its metadata goes into buffers that stay put. FlashInfer then sizes the captured grid for
    the worst ragged split of those tokens, so any later plan of the same shape replays."""

    def __init__(self, workspace: Tensor, *, num_heads: int, num_kv_heads: int, head_dim: int, page_tokens: int,
                 dtype: torch.dtype, graph: tuple[int, int] | None = None, cache_dtype: torch.dtype | None = None):
        import flashinfer

        self._shape = (num_heads, num_kv_heads, head_dim, page_tokens)
        self._dtype, self._cache_dtype = dtype, cache_dtype or dtype
        self._device = workspace.device
        self._graph = graph
        buffers = {}
        if graph is not None:
            requests, max_pages = graph

            def zeros(n: int) -> Tensor:
                return torch.zeros(n, dtype=torch.int32, device=workspace.device)

            buffers = dict(use_cuda_graph=True, qo_indptr_buf=zeros(requests + 1),
                           paged_kv_indptr_buf=zeros(requests + 1), paged_kv_indices_buf=zeros(max_pages),
                           paged_kv_last_page_len_buf=zeros(requests))
        self.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", **buffers)

    def plan(self, layout: PagedLayout, scale: float) -> None:
        num_heads, num_kv_heads, head_dim, page_tokens = self._shape
        indices = layout.indices
        if self._graph is not None:
            requests, max_pages = self._graph
            if layout.kv_lens.numel() != requests or indices.numel() > max_pages:
                raise ValueError(f"FlashInferPrefill graph backend for {requests} requests over at most {max_pages} "
                                 f"pages: the layout has {layout.kv_lens.numel()} requests and {indices.numel()} "
                                 "pages (pad the batch)")
            # Up asynchronously first: the wrapper copies host page ids into its buffer with a
            # blocking copy, which would make the host wait for the steps still running.
            indices = to_device(indices, torch.int32, self._device)
        self.wrapper.plan(layout.qo_indptr, layout.indptr, indices, layout.last_page_len, num_heads,
                          num_kv_heads, head_dim, page_tokens, causal=True, sm_scale=scale,
                          q_data_type=self._dtype, kv_data_type=self._cache_dtype, non_blocking=True)

    def run(self, q: Tensor, k_layer: Tensor, v_layer: Tensor, scale: float) -> Tensor:
        return self.wrapper.run(q, (k_layer, v_layer))
