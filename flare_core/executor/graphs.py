"""The CUDA runner: steps replay CUDA graphs captured at load, one per capacity of the core's
graph catalog, all sharing one memory pool: decode batch capacities (rows) and prefill token
capacities (prompt chunks of several requests; a mixed step's decode rows join its chunks as
one-token requests). Matmuls of one token (the capacity-1 decode graph: a single request
decoding) run a Triton GEMV kernel (flare_core.kernels.gemv) when the model was built with it
(flare_core.ops.serving). Speculative rounds (decode steps whose rows check draft tokens) replay
graphs of their token capacities: each decode row is a request of its input token and its drafts,
with logits, and samples, at every token. Steps no graph covers (steps that restore a prompt's
stored logits or score prompts, prompt chunks of kernels without prefill graphs, drafts beside
prompt chunks) run the same model eagerly over FlashInfer paged prefill.

A model whose attention reads the page table itself (`BatchAttention`: DeepSeek V4 / V4.1, whose
decode steps read compressed records, indexer keys and top-k over as many pages as the table
holds) gets its decode graphs of each capacity at several page-table widths (`decode_widths`:
4,096 tokens' pages, four times that, ..., the whole context): a step replays the narrowest that
holds its longest row, so a short request does not pay for the context the core allows.

A step pads to the smallest covering capacity. Padding rows and tokens read and write a scratch
page that no request owns, so a replay never touches live cache pages beyond its own rows.
Between replays only buffer contents change: token ids, positions, cache indices, sampling
columns, and the FlashInfer plan (made on the host from the scheduler's page tables before the
replay). Recurrent layers (schemes with continuation state) read and write their requests'
state rows through the `state_rows` input of decode graphs and the `_ChunkLayout` of prefill
and speculative graphs, which tells them each request's state row (padding: the scratch row)
and where its tokens start. Steps that restore prefix resume points without stored logits replay
graphs too: the restores are copies made before the replay. Sampling runs in graphs as well,
over the forward graph's logits (`_Samplers`): every request parameter, per-request seeds, and
penalties read from the device state's history book.

Nothing in a step waits for the device: host data goes up through pinned memory, so the engine
can issue step N+1 while the GPU still runs step N (`frames_in_flight`). With `compile_model`,
the model's decoder layers run through torch.compile in groups (flare_core.ops.model.CompiledDecoder:
Inductor fuses the norms, rotary, cache writes, activation code and residual adds between the
matmuls; attention is one opaque op, see flare_core.ops.opaque) before the graphs are captured
over them.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any

import structlog
import torch

from flare_core.contract import CacheScheme
from flare_core.executor.backends import kernels_for
from flare_core.executor.eager import EagerRunner, Sequences, checks_drafts, scores_prompt
from flare_core.executor.runner import HostCopies, ModelRunner
from flare_core.executor.state import DeviceState
from flare_core.executor.storage import TORCH_DTYPES
from flare_core.kernels.flashinfer_attention import WORKSPACE_BYTES, PagedLayout
from flare_core.ops.attention import LINEAR_CHUNK_TOKENS, AttentionBatch, ForwardContext, cache_index, linear_chunks
from flare_core.ops.model import CompiledDecoder
from flare_core.ops.tables import allocate_staging, embedding_tables
from flare_core.executor.sampling import (FLOAT_COLUMNS, INT_COLUMNS, SampleOutput, Sampler, StepSampling, constrain, penalise, row_columns, sample_rows, window)
from flare_core.kernels.transfer import to_device, upload
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


class _Inputs:
    """Named rows of one device tensor [rows, width] that a captured graph reads: the host fills
    them all in one upload per step (one copy from pinned memory), the graph holds views
    (`block["positions"]`) whose addresses never change."""

    def __init__(self, defaults: dict[str, int | float], width: int, dtype: torch.dtype, device: torch.device):
        self.defaults = defaults
        self.tensor = torch.tensor([[value] * width for value in defaults.values()], dtype=dtype, device=device)
        self._rows = {name: index for index, name in enumerate(defaults)}

    @property
    def width(self) -> int:
        return self.tensor.shape[1]

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensor[self._rows[name]]

    def upload(self, rows: dict[str, list]) -> None:
        """Set every row: those named in `rows`, the others to their defaults."""
        upload(self.tensor, [rows[name] if name in rows else [default] * self.width
                             for name, default in self.defaults.items()])


# A graph's integer inputs, one column per row of the graph (a decode graph's rows are its decode
# rows; a prefill graph's rows are its requests). `ids`: the tokens the host knows; `from_device`:
# the row (a decode row, in a prefill graph one of the first requests) reads its token from the
# step before, on the device, instead; `last_token_index`
# (prefill): the flattened index of each request's last token, whose logits the row gets;
# `first_token` (speculative graphs, whose rows are tokens): the index of the first token of the
# row's decode (the drafts after it and up to the row count as output in the row's penalties);
# `state_rows`: the state row of each row that samples (the scratch row for padding and, in prefill
# graphs, for chunks that do not end their prompts); `positions` and `cache_indices` (decode);
# then the sampling columns and the unseeded key (column 0).
INT_INPUTS = ("ids", "from_device", "last_token_index", "first_token", "state_rows", "positions", "cache_indices",
              *INT_COLUMNS, "key")
# The float inputs (the sampling columns of those names) and their values on rows that sample
# without them (padding, greedy steps).
FLOAT_INPUTS = {"temperature": 0.0, "top_p": 1.0, "min_p": 0.0, "repetition": 1.0, "frequency": 0.0,
                "presence": 0.0}
assert tuple(FLOAT_INPUTS) == FLOAT_COLUMNS
# A prefill graph's inputs per token: token ids, positions, cache indices.
TOKEN_INPUTS = ("ids", "positions", "cache_indices")

# The candidate window of the windowed sampler: steps whose rows keep their rank filters exact
# within the 64 most probable tokens (top-k <= 64, and no top-p without a top-k) sample with one
# `topk` of that width; others sort the whole vocabulary (the full sampler).
GRAPH_SAMPLING_WINDOW = 64


@dataclass
class _Samplers:
    """Graphs that sample a graph's logits rows on the device and record the tokens as their
    state rows' next decode inputs: greedy, windowed, full-vocabulary, and both of these with
    penalties (they also count the tokens in the state rows' penalty histories). `tokens` holds
    what the last replay sampled."""

    greedy: torch.cuda.CUDAGraph
    windowed: torch.cuda.CUDAGraph
    full: torch.cuda.CUDAGraph
    penalised_windowed: torch.cuda.CUDAGraph
    penalised: torch.cuda.CUDAGraph
    tokens: torch.Tensor

    def for_step(self, sampling: StepSampling, vocab_size: int) -> torch.cuda.CUDAGraph:
        penalised = sampling.penalised
        if sampling.greedy and not penalised:
            return self.greedy
        if window(sampling.params, vocab_size) <= GRAPH_SAMPLING_WINDOW:
            return self.penalised_windowed if penalised else self.windowed
        return self.penalised if penalised else self.full


class _ChunkLayout:
    """Where a prefill (or speculative) graph's requests' tokens lie and what they continue, for
    recurrent layers: `query_start` (int32 [requests + 1]), the (request, chunk) index of their
    chunks (`chunk_indices`, int64, one row per chunk the graph's tokens can make) and each
    request's state row (`state_rows`, int64 [requests]; the scratch row for padding and empty
    requests). Rows beyond the step's chunks name chunk 0 of the last request, which is always
    empty: the chunked kernels load and store nothing for a request without tokens, so those
    rows only pad the index to its captured size. (Per request, not per graph row: a speculative
    graph's rows are its tokens, and it may hold more requests than tokens.)"""

    def __init__(self, capacity: int, requests: int, device: torch.device, scratch_row: int):
        self.requests, self.scratch_row = requests, scratch_row
        self.query_start = torch.zeros(requests + 1, dtype=torch.int32, device=device)
        self.chunk_indices = torch.zeros(capacity // LINEAR_CHUNK_TOKENS + requests, 2, dtype=torch.int64,
                                         device=device)
        self.state_rows = torch.full((requests,), scratch_row, dtype=torch.int64, device=device)
        self.upload([capacity], [])

    def upload(self, lengths: list[int], state_rows: list[int]) -> None:
        """Lay out requests of `lengths` tokens (the step's chunks, then padding) continuing
        `state_rows` (the step's chunks'), the rest empty."""
        lengths = lengths + [0] * (self.requests - len(lengths))
        assert lengths[-1] == 0, "the last request of a prefill graph stays empty"
        chunks = linear_chunks(lengths)
        chunks += [(self.requests - 1, 0)] * (self.chunk_indices.shape[0] - len(chunks))
        upload(self.query_start, list(itertools.accumulate(lengths, initial=0)))
        upload(self.chunk_indices, chunks)
        upload(self.state_rows, state_rows + [self.scratch_row] * (self.requests - len(state_rows)))


@dataclass(frozen=True)
class PrefillStepInputs:
    """A step's inputs to a prefill graph of `capacity` tokens over `requests` requests
    (`prefill_step_inputs`). Requests in order: the decode rows, each a one-token request; the
    prompt chunks; the padding request, which owns the tokens beyond theirs (over the scratch
    page); empty requests (no tokens) up to `requests`."""

    tokens: dict[str, list[int]]  # per token (TOKEN_INPUTS): ids, positions, cache indices
    rows: dict[str, list[int]]    # per request: last_token_index, state_rows, from_device
    chunk_state_rows: list[int]   # per request of the step: the state row its recurrent layers continue
    lengths: list[int]            # tokens per request: the step's rows, then the padding request
    attention: PagedLayout        # the requests for the attention kernels


def prefill_graph_requests(capacity: int, rows: int, state: bool) -> int:
    """The requests a prefill graph of `capacity` tokens holds when `rows` requests may be live:
    each request of a step has at least one token and holds a state row, so at most the smaller
    of the two; then the padding request, and for recurrent layers (`state`) one that stays empty
    (_ChunkLayout)."""
    return min(capacity, rows) + (2 if state else 1)


def prefill_step_inputs(decodes, chunks, capacity: int, requests: int, page_tokens: int, scratch_page: int,
                        scratch_row: int) -> PrefillStepInputs:
    """The inputs of a prefill graph for a step of `decodes` (DecodeEntry) and `chunks`
    (PrefillChunk). A decode row is the chunk [position, position + 1 + drafts) of its request
    (one token unless it checks drafts, see `speculative_step_inputs`): its token comes from the
    host, or with `from_device` from the token its state row sampled last (on the device: the
    step before may still be running); its drafts follow. Logits rows follow the requests
    (decodes first), as the eager executor's do."""
    count = len(decodes) + len(chunks)
    lengths = [1 + len(e.drafts) for e in decodes] + [c.end - c.start for c in chunks]
    used = sum(lengths)
    assert used <= capacity and count < requests, \
        f"a step of {count} rows and {used} tokens exceeds a graph of {requests - 1} rows, {capacity} tokens"
    pad = capacity - used
    ids = [t for e in decodes for t in (0 if e.input_token is None else e.input_token, *e.drafts)]
    ids += [t for c in chunks for t in c.tokens]
    spans = [(e.page_table, e.position, e.position + 1 + len(e.drafts)) for e in decodes]
    spans += [(c.page_table, c.start, c.end) for c in chunks]
    positions = [p for _, start, end in spans for p in range(start, end)]
    indices = [cache_index(pages, p, page_tokens) for pages, start, end in spans for p in range(start, end)]
    # Padding tokens go to the scratch page (its records wrap around: nothing reads them).
    unused = requests - count
    empty = unused - 1
    return PrefillStepInputs(
        tokens={"ids": ids + [0] * pad, "positions": positions + list(range(pad)),
                "cache_indices": indices + [scratch_page * page_tokens + p % page_tokens for p in range(pad)]},
        rows={
            "last_token_index": [end - 1 for end in itertools.accumulate(lengths)] + [capacity - 1] * unused,
            "state_rows": [e.handle.state_row for e in decodes]
            + [c.handle.state_row if c.samples else scratch_row for c in chunks] + [scratch_row] * unused,
            "from_device": [int(e.input_token is None) for e in decodes] + [0] * (requests - len(decodes)),
        },
        lengths=lengths + [pad],
        chunk_state_rows=[e.handle.state_row for e in decodes] + [c.handle.state_row for c in chunks],
        # The padding request holds at least one token (the kernels take no empty last request with pages).
        attention=PagedLayout.from_requests(
            [end for _, _, end in spans] + [max(pad, 1)] + [1] * empty,
            lengths + [pad] + [0] * empty,
            [e.page_table for e in decodes] + [c.page_table for c in chunks]
            + [[scratch_page] * -(-max(pad, 1) // page_tokens)] + [[scratch_page]] * empty, page_tokens))


def speculative_step_inputs(decodes, capacity: int, requests: int, page_tokens: int, scratch_page: int,
                            scratch_row: int) -> PrefillStepInputs:
    """The inputs of a speculative graph of `capacity` tokens over `requests` requests for a
    step of `decodes` (DecodeEntry; some check drafts): the tokens and attention of a prefill
    graph (`prefill_step_inputs`), whose rows are here its tokens, each with a logits row: for
    each token, `from_device` (a decode's first token, when the host has not seen its input),
    its decode's `state_rows` and `first_token`; padding tokens sample for the scratch row."""
    step = prefill_step_inputs(decodes, (), capacity, requests, page_tokens, scratch_page, scratch_row)
    from_device: list[int] = []
    state_rows: list[int] = []
    first_token: list[int] = []
    for e in decodes:
        first_token += [len(state_rows)] * (1 + len(e.drafts))
        from_device += [int(e.input_token is None)] + [0] * len(e.drafts)
        state_rows += [e.handle.state_row] * (1 + len(e.drafts))
    pad = capacity - len(state_rows)
    rows = {"from_device": from_device + [0] * pad, "state_rows": state_rows + [scratch_row] * pad,
            "first_token": first_token + list(range(len(first_token), capacity))}
    return dataclasses.replace(step, rows=rows)


def drafts_before(ids: torch.Tensor, first_token: torch.Tensor, vocab: int) -> torch.Tensor:
    """int32 [T, vocab]: for each token t of a speculative step, how often each token id occurs
    among the drafts of its decode up to t (the tokens (first_token[t], t] of `ids` [T]), which
    its penalties count as output, as plain decoding would have generated them."""
    index = torch.arange(ids.shape[0], device=ids.device)
    counted = (index[None, :] > first_token[:, None]) & (index[None, :] <= index[:, None])
    counts = torch.zeros(ids.shape[0], vocab, dtype=torch.int32, device=ids.device)
    return counts.scatter_add_(1, ids[None, :].expand(ids.shape[0], -1), counted.to(torch.int32))


def decode_step_inputs(decodes, capacity: int, page_tokens: int, scratch_page: int,
                       scratch_row: int) -> tuple[dict[str, list[int]], PagedLayout]:
    """The inputs of a decode graph of `capacity` rows for a step of `decodes` (DecodeEntry),
    by name, and the rows' attention layout; padding rows read and write the scratch page and
    row."""
    pad = capacity - len(decodes)
    positions = [e.position for e in decodes]
    layout = PagedLayout.from_requests(
        [p + 1 for p in positions] + [1] * pad, [1] * capacity,
        [e.page_table for e in decodes] + [[scratch_page]] * pad, page_tokens)
    return {
        "ids": [0 if e.input_token is None else e.input_token for e in decodes] + [0] * pad,
        "from_device": [int(e.input_token is None) for e in decodes] + [0] * pad,
        "state_rows": [e.handle.state_row for e in decodes] + [scratch_row] * pad,
        "positions": positions + [0] * pad,
        "cache_indices": [cache_index(e.page_table, e.position, page_tokens) for e in decodes]
        + [scratch_page * page_tokens] * pad,
    }, layout


def scatter(values: list, where: list[int], rows: int, default) -> list:
    """A column of `rows` entries: `values` at the indices `where`, `default` elsewhere."""
    column = [default] * rows
    for index, value in zip(where, values):
        column[index] = value
    return column


def captured(fn, pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """`fn` run twice on a side stream (warming kernels, compilation and the allocator outside
    the capture), then captured as a CUDA graph in `pool`; the graph and `fn`'s output."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        output = fn()
    return graph, output


def _hidden_into(hidden: list[torch.Tensor], wanted: bool) -> dict[str, Any]:
    """The model's keyword arguments that hand a forward's final hidden states to `hidden` where
    they are `wanted` (a draft head reads them): what the captured forward appends last is the
    graph's own buffer, which every replay rewrites."""
    return {"final_hidden": hidden.append} if wanted else {}


# The narrowest page table decode graphs of page-table models are captured with, in tokens.
NARROWEST_DECODE_TOKENS = 4096


def decode_widths(pages_per_row: int, narrowest: int) -> tuple[int, ...]:
    """Page-table widths (pages per row) to capture decode graphs at, narrowest first: `narrowest`
    pages, four times as many, ... while at most half of `pages_per_row`, then `pages_per_row`
    (a whole context)."""
    widths = []
    while 2 * narrowest <= pages_per_row:
        widths.append(narrowest)
        narrowest *= 4
    return (*widths, pages_per_row)


@dataclass
class _Graph:
    """The graphs of one capacity of the catalog: the forward (inputs -> logits) and its
    samplers. A decode graph's rows are its `capacity` decode rows, whose tokens come in `ints`.
    A prefill graph holds `capacity` tokens (`tokens_in`) of up to `requests - 1` requests
    (decode rows of one token each, then prompt chunks: `prefill_step_inputs`); its rows are the
    requests, the last one (and any unused ones) padding: it owns the tokens beyond the step's,
    over the scratch page. A speculative graph is laid out as a prefill graph over decode rows
    only, each with its drafts (`speculative_step_inputs`), and its rows are its `capacity`
    tokens: every token has a logits row and samples."""

    kind: str  # "decode", "prefill" or "speculative"
    capacity: int
    forward: torch.cuda.CUDAGraph
    samplers: _Samplers
    ints: _Inputs
    floats: _Inputs
    logits: torch.Tensor
    attention: _FencedPlan
    # A captured graph reads raw addresses and does not keep its inputs alive: hold every tensor
    # the capture read (e.g. the logits row indices) for as long as the graph may replay.
    context: ForwardContext
    tokens_in: _Inputs | None = None
    chunks: _ChunkLayout | None = None  # prefill graphs of schemes with continuation state
    hidden: torch.Tensor | None = None  # every token's final hidden state, for a draft head
    replays: int = 0
    mixed_replays: int = 0  # of a prefill graph: replays with decode rows beside the chunks
    width: int = 0  # of a decode graph of a page-table model: its page table's pages per row
    narrower: list[_Graph] = dataclasses.field(default_factory=list)  # the same capacity's, narrowest first

    @property
    def rows(self) -> int:
        """Its logits rows, which its input columns hold one entry each for."""
        return self.ints.width

    def upload_step(self, plan: StepPlan, page_tokens: int, scratch_page: int, scratch_row: int,
                    scale: float) -> dict[str, list[int]]:
        """Plan the step's attention (a prefill or speculative graph's: upload its tokens, each
        decode's input and drafts, then the chunks'); return its rows' inputs by name."""
        if self.kind == "decode":
            inputs, layout = decode_step_inputs(plan.decodes, self.capacity, page_tokens, scratch_page, scratch_row)
            self.attention.plan(layout, scale)
            return inputs
        if self.kind == "speculative":
            step = speculative_step_inputs(plan.decodes, self.capacity, self.context.batch.num_requests, page_tokens,
                                           scratch_page, scratch_row)
        else:
            step = prefill_step_inputs(plan.decodes, plan.prefills, self.capacity, self.rows, page_tokens,
                                       scratch_page, scratch_row)
        assert self.tokens_in is not None
        self.tokens_in.upload(step.tokens)
        self.attention.plan(step.attention, scale)
        if self.chunks is not None:
            self.chunks.upload(step.lengths, step.chunk_state_rows)
        return step.rows


def capture_samplers(logits: torch.Tensor, ints: _Inputs, floats: _Inputs, pool, state: DeviceState,
                     sample_windowed, drafted: Callable[[], torch.Tensor] | None = None) -> _Samplers:
    """The samplers of a graph's `logits` rows, reading their columns from `ints` and `floats`
    and recording into `state`; `sample_windowed`: `sample_rows`, compiled or not, for the
    windowed samplers; `drafted()`: counts that the rows' penalties add to their histories (a
    speculative round's drafts, `drafts_before`)."""
    rows = ints["state_rows"]
    vocab = logits.shape[-1]
    penalties, last_sampled = state.penalties, state.last_sampled
    # Outside the graphs' shared pool: a pool block may be another graph's scratch memory, and
    # the tokens must survive the replays of other graphs until the engine has read them.
    tokens = torch.zeros(logits.shape[0], dtype=torch.int64, device=logits.device)

    def recorded(sampled: torch.Tensor) -> torch.Tensor:
        tokens.copy_(sampled)
        last_sampled.index_put_((rows,), sampled)
        return tokens

    def sampled(working: torch.Tensor, sample, candidates: int) -> torch.Tensor:
        return recorded(sample(
            working, temperature=floats["temperature"], top_k=ints["top_k"], top_p=floats["top_p"],
            min_p=floats["min_p"], seeds=ints["seeds"], steps=ints["steps"], seeded=ints["seeded"] != 0,
            unseeded_seed=ints["key"][0], candidates=candidates))

    def penalised(sample, candidates: int) -> torch.Tensor:
        counts = penalties.output_counts[rows]
        if drafted is not None:
            counts = counts + drafted()
        working = penalise(logits, penalties.in_prompt[rows], counts,
                           floats["repetition"], floats["frequency"], floats["presence"])
        chosen = sampled(working, sample, candidates)
        penalties.record(rows, chosen)  # the histories of the rows that have penalties
        return chosen

    windowed = min(GRAPH_SAMPLING_WINDOW, vocab)
    graphs = [captured(fn, pool)[0] for fn in (
        lambda: recorded(logits.argmax(dim=-1)),
        lambda: sampled(logits, sample_windowed, windowed),
        lambda: sampled(logits, sample_rows, vocab),
        lambda: penalised(sample_windowed, windowed),
        lambda: penalised(sample_rows, vocab))]
    return _Samplers(*graphs, tokens)


class CudaAttention:
    """The attention kernels of one model on CUDA (FlashInfer paged GQA or MLA, chosen from the
    model's attention modules; the Triton one-row decode kernels where the shape allows): the
    kernel factory the graphs' attention is made from, and the prefill planned per step for the
    steps that run eagerly (`plan_prefill`)."""

    def __init__(self, model: torch.nn.Module, scheme: CacheScheme, page_tokens: int, dtype: torch.dtype | None,
                 device: torch.device):
        # The kernels take queries of the model's activation dtype (`dtype`; None: that of its
        # first parameter that is no FP8 weight) over pages of the paged stores' dtype.
        cache_dtypes = {TORCH_DTYPES[store.dtype] for store in scheme.paged}
        if len(cache_dtypes) != 1:
            raise ValueError(f"the paged stores of cache scheme {scheme.name!r} must share one dtype for the "
                             f"attention kernels, got {sorted(store.dtype for store in scheme.paged)}")
        if dtype is None:
            dtype = next(p.dtype for p in model.parameters() if p.dtype.is_floating_point and p.dtype.itemsize > 1)
        self.page_tokens = page_tokens
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.kernels = kernels_for(model, self.workspace, page_tokens, dtype, cache_dtypes.pop())
        self.scale = self.kernels.scale
        self._prefill = _FencedPlan(self.kernels.prefill())

    def plan_prefill(self, sequences: Sequences) -> _FencedPlan:
        """FlashInfer paged prefill planned for an eager step's rows (decodes are one-token rows)."""
        layout = PagedLayout.from_requests([c + n for n, c, _ in sequences], [n for n, _, _ in sequences],
                                           [pages for _, _, pages in sequences], self.page_tokens)
        self._prefill.plan(layout, self.scale)
        return self._prefill


def _decode_batch(capacity: int, page_table: torch.Tensor, cache_indices: torch.Tensor,
                  state_rows: torch.Tensor | None, page_tokens: int) -> AttentionBatch:
    """The batch a decode graph of `capacity` rows is captured over: one token a row, its page
    table, cache indices and state rows inputs written before each replay."""
    device = cache_indices.device
    return AttentionBatch(
        query_start=torch.arange(capacity + 1, dtype=torch.int32, device=device),
        kv_lens=torch.ones(capacity, dtype=torch.int32, device=device), page_table=page_table,
        slot_mapping=cache_indices, logits_indices=torch.arange(capacity, device=device), page_tokens=page_tokens,
        query_start_host=tuple(range(capacity + 1)), kv_lens_host=(1,) * capacity, state_rows=state_rows,
        one_token_each=True)


def _decode_ids(ints: _Inputs, last_sampled: torch.Tensor) -> torch.Tensor:
    """A decode graph's token ids: each row's uploaded id, or its request's last sampled token."""
    return torch.where(ints["from_device"] != 0, last_sampled[ints["state_rows"]], ints["ids"])


def _table_stager(model: torch.nn.Module, tokens: int, device: torch.device) -> Callable | None:
    """For a model that reads embedding tables (flare_core.ops.tables): staging buffers for decode
    steps of up to `tokens` rows and its `stage_tables`, which fills them before a decode graph
    replays; None for a model without tables."""
    served = model.model if isinstance(model, CompiledDecoder) else model
    if not embedding_tables(served):
        return None
    allocate_staging(served, tokens, device)
    return served.stage_tables


class GraphRunner:
    """Captures one graph per catalog capacity over the device state and replays the smallest
    that covers a step (`can_run`: decode-only or with prompt chunks, no stored logits restored,
    no prompt scores). The steps it cannot run go to the eager runner (flare_core.executor.runner);
    both read and write the same `DeviceState`."""

    def __init__(self, model: torch.nn.Module, state: DeviceState, attention: CudaAttention, sampler: Sampler,
                 copies: HostCopies, *, decode_capacities: tuple[int, ...], prefill_capacities: tuple[int, ...],
                 context_length: int, compiled: bool, prefill_chunk_size: int, triton_attention: bool = True,
                 speculative_capacities: tuple[int, ...] = (),
                 final_hidden: Callable[[StepPlan, torch.Tensor], None] | None = None,
                 eager_model: torch.nn.Module | None = None, narrowest_decode_tokens: int = NARROWEST_DECODE_TOKENS):
        """`final_hidden(plan, hidden)`: handed the final hidden states of every token a replayed
        step computes, in the eager runner's order (a draft head's input, EagerRunner);
        `eager_model`: what the steps that run eagerly call (None: `model`);
        `narrowest_decode_tokens`: the narrowest page table of a page-table model's decode graphs."""
        assert state.scratch_page is not None, "graphs pad onto a scratch page: DeviceState(scratch_page=True)"
        self.model, self.state, self.attention, self.sampler, self.copies = model, state, attention, sampler, copies
        self._eager_model = eager_model if eager_model is not None else model
        self.device, self.page_tokens = state.device, state.page_tokens
        self.vocab_size = state.logits_store.shape[1]
        self.kernels, self.scale = attention.kernels, attention.scale
        self._pages_per_context = -(-context_length // self.page_tokens)
        self._decode_widths = decode_widths(self._pages_per_context + 1, -(-narrowest_decode_tokens // self.page_tokens)) \
            if self.kernels.page_table_input else (self._pages_per_context + 1,)
        # The capacity-1 decode graph (one request decoding) attends through the Triton kernels of
        # flare_core.kernels.decode_attention where the model's shape allows, unless `triton_attention`
        # is off; wider batches keep FlashInfer's decode.
        self._triton_rows = 1 if triton_attention and self.kernels.triton_decode else 0
        self._compiled = compiled
        self._prefill_chunk_size = prefill_chunk_size
        self._final_hidden = final_hidden
        # Inside the graphs, Inductor fuses the windowed sampler's passes over the [rows, vocab]
        # logits. The full-vocabulary samplers are dominated by their sort and run as they are.
        self._sample_rows = torch.compile(sample_rows, dynamic=True) if compiled else sample_rows
        self.decode_graphs: dict[int, _Graph] = {}  # by batch capacity (rows)
        self.prefill_graphs: dict[int, _Graph] = {}  # prefill graphs by token capacity
        self.speculative_graphs: dict[int, _Graph] = {}  # speculative rounds by token capacity
        self._decode_capacities = decode_capacities if self.kernels.graph_decode else ()
        self._stage_tables = _table_stager(model, max(self._decode_capacities, default=0), self.device)
        self._prefill_capacities = prefill_capacities if self.kernels.graph_prefill else ()
        self._speculative_capacities = speculative_capacities if self.kernels.graph_prefill else ()
        self.compile_s = self.capture_s = 0.0
        self.graph_bytes = 0  # what the first warm-up and capture took beyond the state (compilation, the pool)
        self._warmed = False

    @property
    def scratch_page(self) -> int:
        assert self.state.scratch_page is not None
        return self.state.scratch_page

    @property
    def scratch_row(self) -> int:
        return self.state.scratch_row

    def summary(self) -> str:
        """How steps run and what was compiled and captured, for the startup log."""
        compiled = f"torch.compile {self.compile_s:.1f} s, " if self.compile_s else "not compiled, "
        prefill = (f"prompt chunks (with decode rows beside them) of {sorted(self.prefill_graphs)} tokens"
                   if self.prefill_graphs else "no prompt-chunk graphs (eager FlashInfer prefill)")
        if self.speculative_graphs:
            prefill += f", speculative rounds of {sorted(self.speculative_graphs)} tokens"
        widths = f" (page tables of {', '.join(map(str, self._decode_widths))} pages)" if len(self._decode_widths) > 1 \
            else ""
        return (f"CUDA graphs for decode batches {sorted(self.decode_graphs)}{widths} and {prefill}, sampling inside "
                f"({compiled}captured in {self.capture_s:.1f} s, {self.graph_bytes / 2**20:.0f} MiB)")

    def prepare(self) -> None:
        """Warm (compile) and capture over the device state's current storage: at construction,
        and again after `release` and a resize of the state. Compiled code is kept over a resize:
        the page count is unbacked (flare_core.executor.storage), so no guard of the compiled
        layers depends on it; it is warmed again all the same, so that should a guard fail it
        compiles here and not in the first requests (a compilation inside serving once stalled
        the first eager steps of the 12-layer Qwen3-30B-A3B shape 20 s each on the H200; the
        expected cost is three eager steps)."""
        first = not self._warmed
        reserved = torch.cuda.memory_reserved(self.device)
        if self._compiled or first:
            self._warm_eager()
            self._warmed = True
        self._capture()
        if first:  # later captures reuse what the allocator keeps reserved
            self.graph_bytes = torch.cuda.memory_reserved(self.device) - reserved

    def release(self) -> None:
        """Drop the captured graphs (and the memory pool they share)."""
        self.decode_graphs.clear()
        self.prefill_graphs.clear()
        self.speculative_graphs.clear()

    # ---- compile and capture ---------------------------------------------------------------

    def _warm_eager(self) -> None:
        """Run the eager path once per step kind over the current storage. Compiled (each decoder
        layer with symbolic token counts, one code for all layers): a prompt chunk and a decode row
        (size 1 compiles apart), so that compilation happens at load, not in the first requests;
        where eager steps run uncompiled (`compiled_eager_steps`), the decode row alone if graphs
        replay it. Then the largest prompt chunk: the allocator keeps its activations' memory
        reserved, so a KV pool sized afterwards (`resize_cache`) leaves room for eager steps; with
        compiled eager steps, it also compiles the path of many tokens (MoE: grouped_mm)."""
        started = time.perf_counter()
        # (tokens, requests, model): two requests give two logits rows (one compiles apart from several).
        compiled_steps = self._compiled and (self.kernels.compiled_eager_steps or bool(self._decode_capacities))
        steps = [(3, 2, self.model)] if compiled_steps and self.kernels.compiled_eager_steps else []
        steps += [(1, 1, self.model)] if compiled_steps else []
        steps += [(self._prefill_chunk_size, 1, self._eager_model)] if self._prefill_chunk_size else []
        for tokens, requests, model in steps:
            self._warm_prefill(tokens, requests, model)
        torch.cuda.synchronize()
        if self._compiled:
            self.compile_s += time.perf_counter() - started
            log.info("compiled decoder layers", seconds=round(self.compile_s, 1))

    @torch.inference_mode()
    def _warm_prefill(self, tokens: int, requests: int, model: torch.nn.Module) -> None:
        """Run `model`'s prefill path once over `tokens` scratch-page tokens of `requests` requests,
        the first holding all but one token for each other (continuation state: the scratch row)."""
        sequences = [(n, 0, [self.scratch_page] * -(-n // self.page_tokens))
                     for n in [tokens - requests + 1] + [1] * (requests - 1)]
        state_rows = [self.scratch_row] * requests if self.state.scheme.state else ()
        batch = AttentionBatch.build(sequences, self.page_tokens, self.device, state_rows=state_rows)
        context = ForwardContext(batch, self.state.storage, self.attention.plan_prefill(sequences),
                                 layer_map=self.state.layer_map)
        model(torch.zeros(tokens, dtype=torch.int64, device=self.device), batch.positions(), context)

    def _scratch_layout(self, rows: int) -> PagedLayout:
        return PagedLayout.from_requests([1] * rows, [1] * rows, [[self.scratch_page]] * rows, self.page_tokens)

    @torch.inference_mode()
    def _capture(self) -> None:
        started = time.perf_counter()
        pool = None
        # The largest graphs are captured first; the others reuse their memory pool.
        for capacity in sorted(self._prefill_capacities, reverse=True):
            graph = self._capture_prefill(capacity, pool)
            pool = graph.forward.pool()
            self.prefill_graphs[capacity] = graph
        for capacity in sorted(self._speculative_capacities, reverse=True):
            graph = self._capture_prefill(capacity, pool, speculative=True)
            pool = graph.forward.pool()
            self.speculative_graphs[capacity] = graph
        for capacity in sorted(self._decode_capacities, reverse=True):
            for width in reversed(self._decode_widths):  # the whole context's first, then narrower
                graph = self._capture_decode(capacity, width, pool)
                pool = graph.forward.pool()
                if width == self._decode_widths[-1]:
                    self.decode_graphs[capacity] = graph
                else:
                    self.decode_graphs[capacity].narrower.insert(0, graph)
        torch.cuda.synchronize()
        self.capture_s += time.perf_counter() - started  # over every capture, `resize_cache`'s included
        log.info("captured CUDA graphs", decode_capacities=sorted(self.decode_graphs),
                 prefill_capacities=sorted(self.prefill_graphs),
                 speculative_capacities=sorted(self.speculative_graphs), seconds=round(self.capture_s, 2))

    def _int_inputs(self, width: int) -> _Inputs:
        defaults = dict.fromkeys(INT_INPUTS, 0)
        defaults.update(state_rows=self.scratch_row, cache_indices=self.scratch_page * self.page_tokens)
        return _Inputs(defaults, width, torch.int64, self.device)

    def _capture_decode(self, capacity: int, width: int, pool) -> _Graph:
        device = self.device
        attention = _FencedPlan(self.kernels.decode(capacity, capacity * width, triton=capacity <= self._triton_rows))
        ints = self._int_inputs(capacity)
        floats = _Inputs(FLOAT_INPUTS, capacity, torch.float32, device)
        page_table = attention.backend.page_table if self.kernels.page_table_input else \
            torch.full((capacity, 1), self.scratch_page, dtype=torch.int32, device=device)
        batch = _decode_batch(capacity, page_table, ints["cache_indices"],
                              ints["state_rows"] if self.state.scheme.state else None, self.page_tokens)
        context = ForwardContext(batch, self.state.storage, attention, layer_map=self.state.layer_map,
                                 staged_tables=self._stage_tables is not None)
        attention.plan(self._scratch_layout(capacity), self.scale)
        hidden: list[torch.Tensor] = []

        def forward() -> torch.Tensor:
            return self.model(_decode_ids(ints, self.state.last_sampled), ints["positions"], context,
                              **_hidden_into(hidden, self._final_hidden is not None))

        forward_graph, logits = captured(forward, pool)
        samplers = capture_samplers(logits, ints, floats, forward_graph.pool(), self.state, self._sample_rows)
        return _Graph("decode", capacity, forward_graph, samplers, ints, floats, logits, attention, context,
                      hidden=hidden[-1] if hidden else None, width=width)

    def _capture_prefill(self, capacity: int, pool, speculative: bool = False) -> _Graph:
        """A prefill graph of `capacity` tokens, or with `speculative` a speculative round of
        that many: decode rows only, each a request of its input token and drafts, whose rows are
        its tokens, each with a logits row (`speculative_step_inputs`)."""
        device = self.device
        state = bool(self.state.scheme.state)
        requests = prefill_graph_requests(capacity, self.scratch_row, state)
        pad_pages = -(-capacity // self.page_tokens)
        attention = _FencedPlan(self.kernels.prefill(
            graph=(requests, (requests - 1) * self._pages_per_context + pad_pages + requests)))
        tokens_in = _Inputs({"ids": 0, "positions": 0, "cache_indices": self.scratch_page * self.page_tokens},
                            capacity, torch.int64, device)
        rows = capacity if speculative else requests
        ints = self._int_inputs(rows)
        ints["last_token_index"].fill_(capacity - 1)
        floats = _Inputs(FLOAT_INPUTS, rows, torch.float32, device)
        # Only slot_mapping and logits_indices are read on the FlashInfer path, and the chunk
        # layout and state rows by recurrent layers; the rest describes the capture's layout (all
        # tokens in the padding request).
        chunks = _ChunkLayout(capacity, requests, device, self.scratch_row) if state else None
        batch = AttentionBatch(
            query_start=chunks.query_start if chunks is not None else
            torch.tensor([0] + [capacity] * requests, dtype=torch.int32, device=device),
            kv_lens=torch.tensor([capacity] + [1] * (requests - 1), dtype=torch.int32, device=device),
            page_table=torch.full((requests, 1), self.scratch_page, dtype=torch.int32, device=device),
            slot_mapping=tokens_in["cache_indices"],
            logits_indices=torch.arange(capacity, device=device) if speculative else ints["last_token_index"],
            page_tokens=self.page_tokens,
            query_start_host=(0,) + (capacity,) * requests, kv_lens_host=(capacity,) + (1,) * (requests - 1),
            state_rows=chunks.state_rows if chunks is not None else None,
            chunk_indices=chunks.chunk_indices if chunks is not None else None)
        context = ForwardContext(batch, self.state.storage, attention, layer_map=self.state.layer_map)
        attention.plan(prefill_step_inputs((), (), capacity, requests, self.page_tokens, self.scratch_page,
                                           self.scratch_row).attention, self.scale)
        last_sampled, head = self.state.last_sampled, min(capacity, requests)
        hidden: list[torch.Tensor] = []

        def forward() -> torch.Tensor:
            ids = tokens_in["ids"]
            if speculative:  # a row reads its token on the device where `from_device` says
                ids = torch.where(ints["from_device"] != 0, last_sampled[ints["state_rows"]], ids)
            else:  # decode rows (the first requests, one token each) may read their token on the device
                sampled = last_sampled[ints["state_rows"][:head]]
                ids = torch.cat([torch.where(ints["from_device"][:head] != 0, sampled, ids[:head]), ids[head:]])
            return self.model(ids, tokens_in["positions"], context,
                              **_hidden_into(hidden, self._final_hidden is not None))

        forward_graph, logits = captured(forward, pool)
        vocab = logits.shape[-1]
        drafted = (lambda: drafts_before(tokens_in["ids"], ints["first_token"], vocab)) if speculative else None
        samplers = capture_samplers(logits, ints, floats, forward_graph.pool(), self.state, self._sample_rows,
                                    drafted)
        return _Graph("speculative" if speculative else "prefill", capacity, forward_graph, samplers, ints, floats,
                      logits, attention, context, tokens_in, chunks, hidden[-1] if hidden else None)

    # ---- steps -----------------------------------------------------------------------------

    def can_run(self, plan: StepPlan) -> bool:
        return self._graph_for(plan) is not None

    def _graph_for(self, plan: StepPlan) -> _Graph | None:
        """The smallest captured graph that covers the step, or None: the step runs eagerly.
        Decode graphs cover decode-only steps; prefill graphs cover steps with prompt chunks,
        with decode rows beside them (mixed steps: each decode row is a one-token request);
        speculative graphs cover decode-only steps whose rows check drafts; all after restoring
        resume points. Steps that sample a prompt's stored logits, score prompts or check drafts
        beside prompt chunks run eagerly."""
        if any(r.logits_row is not None for r in plan.restores) or scores_prompt(plan):
            return None
        if checks_drafts(plan):
            return None if plan.prefills else _smallest(self.speculative_graphs, plan.fed_tokens)
        if plan.prefills:
            return _smallest(self.prefill_graphs, plan.fed_tokens)
        graph = _smallest(self.decode_graphs, len(plan.decodes))
        if graph is not None and graph.narrower:  # the narrowest page table that holds every row's pages
            pages = max(entry.position // self.page_tokens + 1 for entry in plan.decodes)
            return next((narrow for narrow in graph.narrower if narrow.width >= pages), graph)
        return graph

    @torch.inference_mode()
    def step(self, plan: StepPlan, sampling: StepSampling | None) -> SampleOutput | None:
        """Replay the graph that covers `plan` (`can_run`) and sample it (see EagerRunner.step)."""
        graph = self._graph_for(plan)
        assert graph is not None, "GraphRunner.step takes the steps it can run"
        rows = self._replay(graph, plan, sampling)
        if sampling is None:  # the step samples nothing: prompt chunks that do not end their prompts
            return None
        if self.copies.last is not None:
            # The samplers rewrite the tokens buffer the copy stream may still be reading for an
            # earlier step of this graph; the forward is already queued ahead of this wait.
            torch.cuda.current_stream().wait_event(self.copies.last)
        # Logit biases and grammar masks go into the graph's logits, which every sampler and the
        # logprobs read.
        constrain(graph.logits, sampling.token_masks(), sampling.logit_bias, rows)
        graph.samplers.for_step(sampling, self.vocab_size).replay()
        # Views of the graph's buffers: valid until this graph's next replay, which is enqueued
        # after everything the engine enqueues on them (host copies, logprobs).
        logits, tokens = self._rows(graph.logits, rows), self._rows(graph.samplers.tokens, rows)
        return self.sampler.with_logprobs(logits, tokens, sampling.logprobs, sampling.top_logprobs)

    @torch.inference_mode()
    def logits(self, plan: StepPlan) -> torch.Tensor:
        """Replay the graph that covers `plan` without sampling; its logits rows in
        `plan.samples` order (valid until that graph's next replay)."""
        graph = self._graph_for(plan)
        assert graph is not None, "GraphRunner.logits takes the steps it can run"
        return self._rows(graph.logits, self._replay(graph, plan, None))

    def _rows(self, values: torch.Tensor, rows: list[int]) -> torch.Tensor:
        if rows == list(range(len(rows))):
            return values[:len(rows)]
        # Prompt chunks that do not end their prompts sit between those that do; indexing with a
        # host list would copy it synchronously (the host would wait for the step).
        return values.index_select(0, to_device(rows, torch.int64, self.device))

    def _replay(self, graph: _Graph, plan: StepPlan, sampling: StepSampling | None) -> list[int]:
        """Upload the step's inputs, plan its attention and replay the forward graph; take the
        resume points its chunks save. Returns the rows that sample (DeviceState.finish_chunks)."""
        self.state.restore(plan)  # no stored logits here (`_graph_for`): pages and state rows only
        self.state.start_rows(plan)
        ints = graph.upload_step(plan, self.page_tokens, self.scratch_page, self.scratch_row, self.scale)
        floats = {}
        if sampling is not None and not (sampling.greedy and not sampling.penalised):
            # Sampling columns go to the rows that sample, in plan.samples order: every decode
            # row (of a speculative graph: every token), then the chunks that end their prompts.
            decodes = sum(1 + len(d.drafts) for d in plan.decodes)
            where = list(range(decodes)) + [decodes + i for i, chunk in enumerate(plan.prefills) if chunk.samples]
            width = graph.rows
            columns = row_columns(sampling.params, sampling.steps)
            ints.update((name, scatter(columns[name], where, width, 0)) for name in INT_COLUMNS)
            ints["key"] = [self.sampler.unseeded_seed()] + [0] * (width - 1)
            floats = {name: scatter(columns[name], where, width, default)
                      for name, default in FLOAT_INPUTS.items()}
        graph.ints.upload(ints)
        graph.floats.upload(floats)
        if graph.kind == "decode" and self._stage_tables is not None:  # host reads: before the replay
            self._stage_tables(_decode_ids(graph.ints, self.state.last_sampled), graph.ints["positions"], graph.context)
        graph.forward.replay()
        graph.replays += 1
        graph.mixed_replays += bool(plan.decodes and plan.prefills)
        if self._final_hidden is not None:
            assert graph.hidden is not None
            self._final_hidden(plan, graph.hidden[:plan.fed_tokens])
        return self.state.finish_chunks(plan, graph.logits)


def _smallest(graphs: dict[int, _Graph], size: int) -> _Graph | None:
    """The graph of the smallest capacity that holds `size`, or None."""
    return next((graphs[c] for c in sorted(graphs) if c >= size), None)


def cuda_runner(model: torch.nn.Module, scheme: CacheScheme, *, num_pages: int, page_tokens: int, num_rows: int,
                num_snapshot_rows: int, num_logits_rows: int, vocab_size: int, device: torch.device,
                decode_capacities: tuple[int, ...], context_length: int, prefill_capacities: tuple[int, ...] = (),
                compile_model: bool = False, triton_attention: bool = True, prefill_chunk_size: int = 0,
                seed: int = 0, dtype: torch.dtype | None = None,
                speculative_capacities: tuple[int, ...] = (), round_saves: bool = False,
                final_hidden: Callable[[StepPlan, torch.Tensor], None] | None = None,
                narrowest_decode_tokens: int = NARROWEST_DECODE_TOKENS) -> ModelRunner:
    """The CUDA runner over `num_pages` pages: `model` (built for serving: flare_core.ops.serving)
    called as it is, or through `CompiledDecoder` with `compile_model` (the steps that run eagerly
    too, unless its attention reads host values there: `compiled_eager_steps`), warmed and captured.
    `dtype`: the model's activation dtype (the attention queries'). `speculative_capacities`:
    the token capacities of speculative rounds to capture (none unless the server speculates);
    `round_saves`: it speculates over continuation state (DeviceState); `final_hidden`: handed
    every step's final hidden states, replayed or eager (a draft head's `record`);
    `narrowest_decode_tokens`: see GraphRunner."""
    state = DeviceState(scheme, num_pages=num_pages, page_tokens=page_tokens, num_rows=num_rows,
                        num_snapshot_rows=num_snapshot_rows, num_logits_rows=num_logits_rows, vocab_size=vocab_size,
                        device=device, scratch_page=True, round_saves=round_saves)
    sampler = Sampler(seed=seed, device=device)
    attention = CudaAttention(model, scheme, page_tokens, dtype, device)
    forward = CompiledDecoder(model) if compile_model else model
    eager_forward = forward if attention.kernels.compiled_eager_steps else model
    copies = HostCopies(device)
    graphs = GraphRunner(forward, state, attention, sampler, copies, decode_capacities=decode_capacities,
                         prefill_capacities=prefill_capacities, context_length=context_length,
                         compiled=compile_model, prefill_chunk_size=prefill_chunk_size,
                         triton_attention=triton_attention, speculative_capacities=speculative_capacities,
                         final_hidden=final_hidden, eager_model=eager_forward,
                         narrowest_decode_tokens=narrowest_decode_tokens)
    runner = ModelRunner(state, sampler, EagerRunner(eager_forward, state, sampler, attention.plan_prefill, final_hidden),
                         copies, graphs)
    graphs.prepare()
    return runner
