"""The CUDA executor: decode steps replay CUDA graphs captured at load, one per decode batch
capacity of the core's graph catalog, all sharing one memory pool; steps with prompt chunks run
FlashInfer paged prefill.

A decode step pads its rows to the smallest covering capacity. Padding rows read and write a
scratch page that no request owns, so a replay never touches live cache pages beyond its own
rows. Between replays only buffer contents change: token ids, positions, cache slots, and the
FlashInfer plan (made on the host from the scheduler's page tables before the replay).

Nothing in a step waits for the device: host data goes up through pinned memory, so the engine
can issue step N+1 while the GPU still runs step N (`frames_in_flight`). With `compile_model`,
the model's decoder layers run through torch.compile (Inductor fuses the norms, rotary and
activation code between the matmuls) before the graphs are captured over them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import structlog
import torch

from flare_core.contract import CacheScheme
from flare_core.executor.eager import EagerExecutor
from flare_core.ops.attention import AttentionBatch, ForwardContext
from flare_core.ops.flashinfer_attention import WORKSPACE_BYTES, PagedLayout
from flare_core.ops.kernels import kernels_for
from flare_core.ops.transfer import to_device
from flare_core.scheduler import StepPlan

log = structlog.get_logger("flare.graphs")


class _FencedPlan:
    """A kernel backend whose `plan` first waits until its previous plan reached the device.

    FlashInfer stages a plan in one pinned host buffer per wrapper and copies it to the device
    in stream order. With two steps in flight the host may re-plan a wrapper before the copy
    of its previous plan has run; waiting on an event recorded after that copy (which follows
    the step the engine has just read back, so it is done or about to be) keeps the staged
    plan intact."""

    def __init__(self, backend: Any):
        self.backend = backend
        self._copied: torch.cuda.Event | None = None

    def plan(self, layout: PagedLayout, scale: float) -> None:
        if self._copied is not None:
            self._copied.synchronize()
        self.backend.plan(layout, scale)
        self._copied = torch.cuda.Event()
        self._copied.record()

    def run(self, *args):
        return self.backend.run(*args)

    def run_mla(self, *args):
        return self.backend.run_mla(*args)


@dataclass
class _DecodeGraph:
    capacity: int
    graph: torch.cuda.CUDAGraph
    input_ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    logits: torch.Tensor
    attention: _FencedPlan
    # A captured graph reads raw addresses and does not keep its inputs alive: hold every tensor
    # the capture read (e.g. the logits row indices) for as long as the graph may replay.
    context: ForwardContext
    replays: int = 0


class GraphExecutor(EagerExecutor):
    frames_in_flight = 2

    def __init__(self, model: torch.nn.Module, scheme: CacheScheme, *, num_pages: int, page_tokens: int,
                 num_rows: int, num_snapshot_slots: int, num_logits_slots: int, vocab_size: int,
                 device: torch.device, decode_capacities: tuple[int, ...], context_length: int,
                 compile_model: bool = False):
        # One page beyond the scheduler's pool is the scratch page padding rows write to.
        super().__init__(model, scheme, num_pages=num_pages + 1, page_tokens=page_tokens, num_rows=num_rows,
                         num_snapshot_slots=num_snapshot_slots, num_logits_slots=num_logits_slots,
                         vocab_size=vocab_size, device=device)
        self.scratch_page = num_pages
        first_store = next(iter(self.storage.values()))
        dtype = first_store[0].dtype if first_store else next(model.parameters()).dtype
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.kernels = kernels_for(model, self.workspace, page_tokens, dtype)
        self.scale = self.kernels.scale
        self.prefill_attention = _FencedPlan(self.kernels.prefill())
        self._pages_per_context = -(-context_length // page_tokens)
        self.compile_s = 0.0
        reserved = torch.cuda.memory_reserved(device)
        if compile_model:
            self._compile()
        self.graphs: dict[int, _DecodeGraph] = {}
        self.capture_s = 0.0
        self._capture(decode_capacities)
        # What compilation, warm-up and the graphs' memory pool took beyond the cache storage.
        self.graph_bytes = torch.cuda.memory_reserved(device) - reserved

    # ---- compile and capture ---------------------------------------------------------------

    def _compile(self) -> None:
        """Compile each decoder layer (one compiled code shared by all layers: they differ only in
        weights, which are graph inputs) with symbolic token counts, and run it once per step kind
        so that compilation happens at load, not in the first requests."""
        started = time.perf_counter()
        layers = getattr(getattr(self.model, "model", None), "layers", None)
        if layers is None:
            raise ValueError("compile_model needs a model with model.layers (flare_core.ops.model.DecoderForServing)")
        for layer in layers:
            layer.compile(dynamic=True)
        for tokens in (3, 1):  # a prompt chunk, then a single decode row (size 1 compiles separately)
            self._warm_prefill(tokens)
        torch.cuda.synchronize()
        self.compile_s = time.perf_counter() - started
        log.info("compiled decoder layers", seconds=round(self.compile_s, 1))

    @torch.inference_mode()
    def _warm_prefill(self, tokens: int) -> None:
        """Run the prefill path once over `tokens` scratch-page tokens (nothing live is touched)."""
        pages = [self.scratch_page] * -(-tokens // self.page_tokens)
        batch = AttentionBatch.build([(tokens, 0, pages)], self.page_tokens, self.device)
        self.prefill_attention.plan(PagedLayout.from_requests([tokens], [tokens], [pages], self.page_tokens),
                                    self.scale)
        context = ForwardContext(batch, self.storage, self.prefill_attention)
        self.model(torch.zeros(tokens, dtype=torch.int64, device=self.device), batch.positions(), context)

    def _scratch_layout(self, rows: int) -> PagedLayout:
        return PagedLayout.from_requests([1] * rows, [1] * rows, [[self.scratch_page]] * rows, self.page_tokens)

    @torch.inference_mode()
    def _capture(self, capacities: tuple[int, ...]) -> None:
        started = time.perf_counter()
        pool = None
        for capacity in sorted(capacities, reverse=True):
            attention = _FencedPlan(self.kernels.decode(capacity, capacity * (self._pages_per_context + 1)))
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
            # The largest capacity is captured first; the smaller ones reuse its memory pool.
            with torch.cuda.graph(graph, pool=pool):
                logits = self.model(input_ids, positions, context)
            pool = graph.pool()
            self.graphs[capacity] = _DecodeGraph(capacity, graph, input_ids, positions, slots, logits, attention,
                                                 context)
        torch.cuda.synchronize()
        self.capture_s = time.perf_counter() - started
        if capacities:
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
        pad = capacity - rows
        positions = [e.position for e in plan.decodes]
        slots = [e.page_table[e.position // page_tokens] * page_tokens + e.position % page_tokens
                 for e in plan.decodes]
        graph.input_ids[:rows].copy_(self._input_ids(plan))
        graph.positions.copy_(to_device(positions + [0] * pad, torch.int64, self.device))
        graph.slots.copy_(to_device(slots + [self.scratch_page * page_tokens] * pad, torch.int64, self.device))
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
