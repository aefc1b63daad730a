"""The CUDA executor: decode steps replay CUDA graphs captured at load, one per decode batch
capacity of the core's graph catalog, all sharing one memory pool; steps with prompt chunks run
FlashInfer paged prefill.

A decode step pads its rows to the smallest covering capacity. Padding rows read and write a
scratch page that no request owns, so a replay never touches live cache pages beyond its own
rows. Between replays only buffer contents change: token ids, positions, cache slots, and the
FlashInfer plan (made on the host from the scheduler's page tables before the replay).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import structlog
import torch

from flare_core.contract import CacheScheme
from flare_core.executor.eager import EagerExecutor
from flare_core.ops.attention import AttentionBatch, ForwardContext, PagedAttention
from flare_core.ops.flashinfer_attention import WORKSPACE_BYTES, FlashInferDecode, FlashInferPrefill, PagedLayout
from flare_core.scheduler import StepPlan

log = structlog.get_logger("flare.graphs")


@dataclass
class _DecodeGraph:
    capacity: int
    graph: torch.cuda.CUDAGraph
    input_ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    logits: torch.Tensor
    attention: FlashInferDecode
    # A captured graph reads raw addresses and does not keep its inputs alive: hold every tensor
    # the capture read (e.g. the logits row indices) for as long as the graph may replay.
    context: ForwardContext
    replays: int = 0


class GraphExecutor(EagerExecutor):
    def __init__(self, model: torch.nn.Module, scheme: CacheScheme, *, num_pages: int, page_tokens: int,
                 num_rows: int, num_snapshot_slots: int, num_logits_slots: int, vocab_size: int,
                 device: torch.device, decode_capacities: tuple[int, ...], context_length: int):
        # One page beyond the scheduler's pool is the scratch page padding rows write to.
        super().__init__(model, scheme, num_pages=num_pages + 1, page_tokens=page_tokens, num_rows=num_rows,
                         num_snapshot_slots=num_snapshot_slots, num_logits_slots=num_logits_slots,
                         vocab_size=vocab_size, device=device)
        self.scratch_page = num_pages
        attention = next((m for m in model.modules() if isinstance(m, PagedAttention)), None)
        if attention is None:
            raise ValueError("the CUDA executor needs a model built on flare_core.ops.attention.PagedAttention")
        self.scale = attention.scale
        dtype = self.storage["k"][0].dtype if "k" in self.storage else next(model.parameters()).dtype
        self._heads = dict(num_heads=attention.num_heads, num_kv_heads=attention.num_kv_heads,
                           head_dim=attention.head_dim, page_tokens=page_tokens, dtype=dtype)
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.prefill_attention = FlashInferPrefill(self.workspace, **self._heads)
        self._pages_per_context = -(-context_length // page_tokens)
        self.graphs: dict[int, _DecodeGraph] = {}
        self.capture_s = 0.0
        self._capture(decode_capacities)

    # ---- capture ---------------------------------------------------------------------------

    def _scratch_layout(self, rows: int) -> PagedLayout:
        return PagedLayout.from_requests([1] * rows, [1] * rows, [[self.scratch_page]] * rows, self.page_tokens)

    @torch.inference_mode()
    def _capture(self, capacities: tuple[int, ...]) -> None:
        started = time.perf_counter()
        for capacity in sorted(capacities, reverse=True):
            attention = FlashInferDecode(self.workspace, capacity, capacity * (self._pages_per_context + 1),
                                         use_cuda_graph=True, **self._heads)
            input_ids = torch.zeros(capacity, dtype=torch.int64, device=self.device)
            positions = torch.zeros(capacity, dtype=torch.int64, device=self.device)
            slots = torch.full((capacity,), self.scratch_page * self.page_tokens, dtype=torch.int64,
                               device=self.device)
            batch = AttentionBatch(
                query_start=torch.arange(capacity + 1, dtype=torch.int32, device=self.device),
                kv_lens=torch.ones(capacity, dtype=torch.int32, device=self.device),
                page_table=torch.full((capacity, 1), self.scratch_page, dtype=torch.int32, device=self.device),
                slot_mapping=slots, logits_indices=torch.arange(capacity, device=self.device),
                page_tokens=self.page_tokens, query_start_host=tuple(range(capacity + 1)),
                kv_lens_host=(1,) * capacity)
            context = ForwardContext(batch, self.storage, attention)
            attention.plan(self._scratch_layout(capacity), self.scale)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm up kernels and allocator outside the capture
                    self.model(input_ids, positions, context)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                logits = self.model(input_ids, positions, context)
            self.graphs[capacity] = _DecodeGraph(capacity, graph, input_ids, positions, slots, logits, attention,
                                                 context)
        torch.cuda.synchronize()
        self.capture_s = time.perf_counter() - started
        log.info("captured CUDA graphs", decode_capacities=sorted(self.graphs), seconds=round(self.capture_s, 2))

    # ---- steps -----------------------------------------------------------------------------

    def _forward(self, plan: StepPlan) -> torch.Tensor:
        rows = len(plan.decodes)
        graph = None
        if not plan.prefills:
            graph = next((self.graphs[c] for c in sorted(self.graphs) if c >= rows), None)
        if graph is None:
            return self._forward_prefill(plan)
        return self._replay(graph, plan)

    def _replay(self, graph: _DecodeGraph, plan: StepPlan) -> torch.Tensor:
        rows, capacity, page_tokens = len(plan.decodes), graph.capacity, self.page_tokens
        known = [e.input_token for e in plan.decodes]
        tokens = torch.tensor([t if t is not None else 0 for t in known], dtype=torch.int64)
        positions = [e.position for e in plan.decodes]
        slots = [e.page_table[e.position // page_tokens] * page_tokens + e.position % page_tokens
                 for e in plan.decodes]
        pad = capacity - rows
        graph.input_ids[:rows].copy_(tokens, non_blocking=True)
        missing = [i for i, t in enumerate(known) if t is None]
        if missing:  # tokens sampled by the previous step that the host has not seen yet
            index = torch.tensor(missing, device=self.device)
            slot_ids = torch.tensor([plan.decodes[i].handle.slot for i in missing], device=self.device)
            graph.input_ids.index_copy_(0, index, self.last_sampled[slot_ids])
        graph.positions.copy_(torch.tensor(positions + [0] * pad, dtype=torch.int64), non_blocking=True)
        graph.slots.copy_(torch.tensor(slots + [self.scratch_page * page_tokens] * pad, dtype=torch.int64),
                          non_blocking=True)
        layout = PagedLayout.from_requests(
            [p + 1 for p in positions] + [1] * pad, [1] * capacity,
            [e.page_table for e in plan.decodes] + [[self.scratch_page]] * pad, page_tokens)
        graph.attention.plan(layout, self.scale)
        graph.graph.replay()
        graph.replays += 1
        return graph.logits[:rows]

    def _forward_prefill(self, plan: StepPlan) -> torch.Tensor:
        sequences = self._sequences(plan)
        batch = AttentionBatch.build(sequences, self.page_tokens, self.device)
        layout = PagedLayout.from_requests([c + n for n, c, _ in sequences], [n for n, _, _ in sequences],
                                           [pages for _, _, pages in sequences], self.page_tokens)
        self.prefill_attention.plan(layout, self.scale)
        context = ForwardContext(batch, self.storage, self.prefill_attention)
        return self.model(self._input_ids(plan), batch.positions(), context)
