"""The CUDA executor: decode steps replay CUDA graphs captured at load, one per decode batch
capacity of the core's graph catalog, all sharing one memory pool; steps with prompt chunks run
FlashInfer paged prefill. Matmuls of one token (the capacity-1 graph: a single request decoding)
run a Triton GEMV kernel (flare_core.ops.gemv) unless `gemv=False`.

A decode step pads its rows to the smallest covering capacity. Padding rows read and write a
scratch page that no request owns, so a replay never touches live cache pages beyond its own
rows. Between replays only buffer contents change: token ids, positions, cache slots, and the
FlashInfer plan (made on the host from the scheduler's page tables before the replay).

Nothing in a step waits for the device: host data goes up through pinned memory, so the engine
can issue step N+1 while the GPU still runs step N (`frames_in_flight`). With `compile_model`,
the model's decoder layers run through torch.compile in groups (flare_core.ops.model.compile_layers:
Inductor fuses the norms, rotary, cache writes, activation code and residual adds between the
matmuls; attention is one opaque op, see flare_core.ops.opaque) before the graphs are captured
over them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import structlog
import torch

from flare_core.contract import CacheScheme
from flare_core.executor.eager import EagerExecutor
from flare_core.ops.attention import AttentionBatch, ForwardContext, cache_slot
from flare_core.ops.flashinfer_attention import WORKSPACE_BYTES, PagedLayout
from flare_core.ops.gemv import use_gemv
from flare_core.ops.kernels import kernels_for
from flare_core.ops.model import compile_layers
from flare_core.ops.sampling import SampleOutput, StepSampling, row_columns, sample_rows, window
from flare_core.ops.transfer import upload
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


# A decode graph's inputs arrive in two blocks, one host-to-device copy each per step. Rows of
# the int64 block [INT_ROWS, capacity]: the tokens the host knows, whether a row reads its token
# from the step before on the device instead, the rows' request slots, positions and cache
# slots, then the sampling columns (top-k, seeds, steps, seeded) and the unseeded key (column 0).
(_IDS, _FROM_DEVICE, _ROW_SLOTS, _POSITIONS, _CACHE_SLOTS, _TOP_K, _SEEDS, _STEPS, _SEEDED, _KEY) = range(10)
INT_ROWS = 10
# Rows of the float32 block: temperature, top-p, min-p, and their values on rows that do not
# sample with them (padding, greedy steps): greedy, no top-p, no min-p.
FLOAT_ROWS = 3
_FLOAT_DEFAULTS = (0.0, 1.0, 0.0)

# The candidate window of in-graph sampling: steps whose rows all keep their rank filters exact
# within the 64 most probable tokens (top-k <= 64, and no top-p without a top-k) sample inside
# the decode graph. Others (and rows with penalties) sample eagerly from the graph's logits.
GRAPH_SAMPLING_WINDOW = 64


@dataclass
class _DecodeGraph:
    """The graphs of one decode batch capacity: the forward (input block -> logits), and two
    samplers over its logits (greedy, and `sample_rows` over the sampling columns) that record
    the tokens as their slots' next inputs."""

    capacity: int
    forward: torch.cuda.CUDAGraph
    greedy: torch.cuda.CUDAGraph
    sampled: torch.cuda.CUDAGraph
    ints: torch.Tensor
    floats: torch.Tensor
    logits: torch.Tensor
    tokens: torch.Tensor  # what the last sampler replay sampled
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
                 compile_model: bool = False, gemv: bool = True, prefill_chunk_size: int = 0, seed: int = 0):
        # One page beyond the scheduler's pool is the scratch page padding rows write to.
        super().__init__(model, scheme, num_pages=num_pages + 1, page_tokens=page_tokens, num_rows=num_rows,
                         num_snapshot_slots=num_snapshot_slots, num_logits_slots=num_logits_slots,
                         vocab_size=vocab_size, device=device, seed=seed)
        self.scratch_page = num_pages
        self.scratch_row = num_rows  # the extra row of `last_sampled` padding rows write to
        first_store = next(iter(self.storage.values()))
        dtype = first_store[0].dtype if first_store else next(model.parameters()).dtype
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.kernels = kernels_for(model, self.workspace, page_tokens, dtype)
        self.scale = self.kernels.scale
        self.prefill_attention = _FencedPlan(self.kernels.prefill())
        self._pages_per_context = -(-context_length // page_tokens)
        self.vocab_size = vocab_size
        self.compile_s = 0.0
        # Inside the graphs, Inductor fuses sampling's passes over the [rows, vocab] logits.
        self._sample_rows = torch.compile(sample_rows, dynamic=True) if compile_model else sample_rows
        reserved = torch.cuda.memory_reserved(device)
        if gemv:  # one-token matmuls through the GEMV kernel (flare_core.ops.gemv), before compiling
            use_gemv(self.model)
        if compile_model:
            self._compile()
        if prefill_chunk_size:
            # The largest prompt chunk: the allocator keeps its activations' memory reserved, so a
            # KV pool sized afterwards (`resize_cache`) leaves room for it.
            self._warm_prefill(prefill_chunk_size)
        self.graphs: dict[int, _DecodeGraph] = {}
        self.capture_s = 0.0
        self._capacities = decode_capacities
        self._capture(decode_capacities)
        # What compilation, warm-up and the graphs' memory pool took beyond the cache storage.
        self.graph_bytes = torch.cuda.memory_reserved(device) - reserved

    def resize_cache(self, num_pages: int) -> None:
        """Replace the cache storage by one of `num_pages` pages (plus the scratch page) and
        capture the decode graphs again over it: they read the storage's addresses. Compiled
        code is kept (the page count is a symbolic size). Meant for start-up: the executor is
        first built over a small cache, so that the pool can be sized from the memory that
        compilation, the graphs and the largest prompt chunk leave free."""
        self.graphs.clear()  # frees the graphs' pool: the plan counted it, the new capture takes it again
        self.storage = None
        torch.cuda.synchronize(self.device)
        self.storage = self._allocate_storage(num_pages + 1)
        self.scratch_page = num_pages
        self._capture(self._capacities)

    # ---- compile and capture ---------------------------------------------------------------

    def _compile(self) -> None:
        """Compile each decoder layer (one compiled code shared by all layers: they differ only in
        weights, which are graph inputs) with symbolic token counts, and run it once per step kind
        so that compilation happens at load, not in the first requests."""
        started = time.perf_counter()
        compile_layers(self.model)
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
        # The largest capacity is captured first; the other graphs reuse its memory pool.
        for capacity in sorted(capacities, reverse=True):
            graph = self._capture_capacity(capacity, pool)
            pool = graph.forward.pool()
            self.graphs[capacity] = graph
        torch.cuda.synchronize()
        self.capture_s = time.perf_counter() - started
        if capacities:
            log.info("captured CUDA graphs", decode_capacities=sorted(self.graphs), seconds=round(self.capture_s, 2))

    def _capture_capacity(self, capacity: int, pool) -> _DecodeGraph:
        device = self.device
        attention = _FencedPlan(self.kernels.decode(capacity, capacity * (self._pages_per_context + 1)))
        ints = torch.zeros(INT_ROWS, capacity, dtype=torch.int64, device=device)
        ints[_ROW_SLOTS] = self.scratch_row
        ints[_CACHE_SLOTS] = self.scratch_page * self.page_tokens
        floats = torch.tensor([[value] * capacity for value in _FLOAT_DEFAULTS], dtype=torch.float32, device=device)
        batch = AttentionBatch(
            query_start=torch.arange(capacity + 1, dtype=torch.int32, device=device),
            kv_lens=torch.ones(capacity, dtype=torch.int32, device=device),
            page_table=torch.full((capacity, 1), self.scratch_page, dtype=torch.int32, device=device),
            slot_mapping=ints[_CACHE_SLOTS], logits_indices=torch.arange(capacity, device=device),
            page_tokens=self.page_tokens, query_start_host=tuple(range(capacity + 1)),
            kv_lens_host=(1,) * capacity)
        context = ForwardContext(batch, self.storage, attention)
        attention.plan(self._scratch_layout(capacity), self.scale)

        def forward() -> torch.Tensor:
            ids = torch.where(ints[_FROM_DEVICE] != 0, self.last_sampled[ints[_ROW_SLOTS]], ints[_IDS])
            return self.model(ids, ints[_POSITIONS], context)

        # Outside the graphs' shared pool: a pool block may be another graph's scratch memory, and
        # the tokens must survive the replays of other capacities until the engine has read them.
        tokens = torch.zeros(capacity, dtype=torch.int64, device=device)

        def recorded(sampled: torch.Tensor) -> torch.Tensor:
            tokens.copy_(sampled)
            self.last_sampled.index_put_((ints[_ROW_SLOTS],), sampled)
            return tokens

        forward_graph, logits = self._captured(forward, pool)
        pool = forward_graph.pool()
        greedy_graph, _ = self._captured(lambda: recorded(logits.argmax(dim=-1)), pool)
        sampled_graph, _ = self._captured(lambda: recorded(self._sample_rows(
            logits, temperature=floats[0], top_k=ints[_TOP_K], top_p=floats[1], min_p=floats[2],
            seeds=ints[_SEEDS], steps=ints[_STEPS], seeded=ints[_SEEDED] != 0, unseeded_seed=ints[_KEY, 0],
            candidates=min(GRAPH_SAMPLING_WINDOW, logits.shape[-1]))), pool)
        return _DecodeGraph(capacity, forward_graph, greedy_graph, sampled_graph, ints, floats, logits, tokens,
                            attention, context)

    @staticmethod
    def _captured(fn, pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm up kernels, compilation and the allocator outside the capture
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            output = fn()
        return graph, output

    # ---- steps -----------------------------------------------------------------------------

    def _graph_for(self, plan: StepPlan) -> _DecodeGraph | None:
        """The smallest captured capacity that covers a decode-only step, if any."""
        if plan.prefills:
            return None
        rows = len(plan.decodes)
        return next((self.graphs[c] for c in sorted(self.graphs) if c >= rows), None)

    def _forward(self, plan: StepPlan) -> torch.Tensor:
        graph = self._graph_for(plan)
        if graph is None:
            return self._forward_prefill(plan)
        self._replay(graph, plan, None)
        return graph.logits[:len(plan.decodes)]

    @torch.inference_mode()
    def step(self, plan: StepPlan, sampling: StepSampling | None) -> SampleOutput | None:
        graph = self._graph_for(plan)
        if graph is None or sampling is None or plan.restores or not self._samples_in_graph(sampling):
            return super().step(plan, sampling)
        rows = len(plan.decodes)
        self._replay(graph, plan, sampling)
        (graph.greedy if sampling.greedy else graph.sampled).replay()
        # Views of the graph's buffers: valid until this capacity's next replay, which is enqueued
        # after everything the engine enqueues on them (host copies, penalty counts, logprobs).
        return self.sampler.with_logprobs(graph.logits[:rows], graph.tokens[:rows], sampling.logprobs,
                                          sampling.top_logprobs)

    def _samples_in_graph(self, sampling: StepSampling) -> bool:
        if sampling.penalised:
            return False
        return sampling.greedy or window(sampling.params, self.vocab_size) <= GRAPH_SAMPLING_WINDOW

    def _replay(self, graph: _DecodeGraph, plan: StepPlan, sampling: StepSampling | None) -> None:
        rows, capacity, page_tokens = len(plan.decodes), graph.capacity, self.page_tokens
        pad = capacity - rows
        decodes = plan.decodes
        positions = [e.position for e in decodes]
        ints = [
            [0 if e.input_token is None else e.input_token for e in decodes] + [0] * pad,
            [int(e.input_token is None) for e in decodes] + [0] * pad,
            [e.handle.slot for e in decodes] + [self.scratch_row] * pad,
            positions + [0] * pad,
            [cache_slot(e.page_table, e.position, page_tokens) for e in decodes]
            + [self.scratch_page * page_tokens] * pad,
        ]
        floats = [[value] * capacity for value in _FLOAT_DEFAULTS]
        if sampling is None or sampling.greedy:
            ints += [[0] * capacity] * (INT_ROWS - len(ints))
        else:
            sampling_ints, sampling_floats = row_columns(sampling.params, sampling.steps)
            ints += [column + [0] * pad for column in sampling_ints]
            ints.append([self.sampler.unseeded_seed()] + [0] * (capacity - 1))
            floats = [column + [default] * pad for column, default in zip(sampling_floats, _FLOAT_DEFAULTS)]
        upload(graph.ints, ints)
        upload(graph.floats, floats)
        layout = PagedLayout.from_requests(
            [p + 1 for p in positions] + [1] * pad, [1] * capacity,
            [e.page_table for e in decodes] + [[self.scratch_page]] * pad, page_tokens)
        graph.attention.plan(layout, self.scale)
        graph.forward.replay()
        graph.replays += 1

    def _forward_prefill(self, plan: StepPlan) -> torch.Tensor:
        sequences = self._sequences(plan)
        batch = AttentionBatch.build(sequences, self.page_tokens, self.device)
        layout = PagedLayout.from_requests([c + n for n, c, _ in sequences], [n for n, _, _ in sequences],
                                           [pages for _, _, pages in sequences], self.page_tokens)
        self.prefill_attention.plan(layout, self.scale)
        context = ForwardContext(batch, self.storage, self.prefill_attention)
        return self.model(self._input_ids(plan), batch.positions(), context)
