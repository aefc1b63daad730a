"""A draft model as a proposer for speculative decoding (`flare run CORE --spec-method draft
--spec-draft-core CORE2`): a second, smaller core with the same tokenizer guesses each request's
next tokens by decoding ahead, and the served model checks them in one round.

The draft core runs over a page pool of its own, planned with the served model's pool: as many
tokens, its bytes shared under the same memory budget (flare_core.engine.memory.plan_kv). Each live
request holds a row (`max_concurrency` rows), which takes pages from the pool as it grows; where
none is free, the least recently proposing request's row gives its pages back (that request's
next proposal computes its sequence again). A row remembers the tokens whose records its pages
hold; a proposal computes only what the request's sequence holds beyond their common prefix (after
a round: the target's own token and the drafts it kept, or the refused drafts overwritten), in
chunks of at most the draft core's prefill chunk size, then decodes up to `width` tokens one at a
time (on CUDA each replays the draft core's captured one-row decode graph).

How drafts are drawn (`draft_token`, shared with the draft heads): greedily for greedy requests;
for sampled ones, each draft is drawn as the served model will draw its token at that position —
the same temperature and top-k / top-p / min-p filters over the draft's logits, and the same
exponential noise, keyed by the request's seed and the step (flare_core.executor.sampling). This is
the Gumbel-max coupling of Daliri, Musco and Suresh, "Coupling without Communication and
Drafter-Invariant Speculative Decoding" (arXiv 2408.07978, 2024): the served model's token at a
position equals the draft whenever the noise makes both distributions pick the same token, which
happens with probability at least (1 - d) / (1 + d), d the two distributions' total variation
distance (a greedy guess is kept with probability p(guess) only). The round's coupled
verification stays as it is, so every output is still exactly plain decoding's, seed for seed,
whatever the drafter. The noise of a position must be known when it is drafted, so a sampled
request without a seed is given one of its own at admission (`drawn_alike`), drawn fresh: its
output is as random as with the per-step keys it replaces. What a proposal takes per draft token is
measured (a moving average) and priced into each round (`seconds`). The draft core's cache may keep no
continuation state (its refused drafts could not be rolled back).
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Callable, Generic, Protocol, TypeVar

import torch

from flare_core.engine.load import LoadedCore
from flare_core.executor.runner import eager_runner
from flare_core.executor.sampling import sample_params
from flare_core.requests import GenerationRequest, SamplingParams
from flare_core.scheduler import DecodeEntry, PrefillChunk, RequestHandle, StepKind, StepPlan
from flare_core.scheduler.proposals import Proposer


def drawn_alike(request: GenerationRequest, proposer: Proposer | None) -> tuple[GenerationRequest,
                                                                                 SamplingParams | None]:
    """`request` as the engine serves it, and how its drafts are drawn (None: greedily): a sampled
    request of a server whose proposer samples its drafts, given a fresh seed if it has none (the
    module docstring)."""
    if proposer is None or not proposer.samples or request.sampling.greedy:
        return request, None
    if request.sampling.seed is None:
        sampling = dataclasses.replace(request.sampling, seed=secrets.randbits(63))
        request = dataclasses.replace(request, sampling=sampling)
    return request, request.sampling


def draft_token(logits: torch.Tensor, draw: SamplingParams | None, step: int) -> int:
    """The draft that follows `logits` [1, V]: the argmax, or with `draw` the token the served
    model's sampler draws at `step` from these logits (its penalties and constraints left out: they
    only make the draft guess less well)."""
    if draw is None or draw.greedy:
        return int(logits[0].argmax())
    return int(sample_params(logits[:1].float(), [draw], [step], unseeded_seed=0)[0])  # `draw` is seeded


@dataclass(eq=False)
class _Row:
    index: int
    tokens: list[int] = field(default_factory=list)  # whose records the row's pages hold, in order
    pages: list[int] = field(default_factory=list)  # its page table, taken from the pool as it grows


class _PagedRow(Protocol):
    index: int
    pages: list[int]  # its page table


R = TypeVar("R", bound=_PagedRow)


class RowsByRequest(Generic[R]):
    """A proposer's `rows` cache rows, each held by one request (least recently used first), and
    the pool of pages their page tables take as they grow (`provide`). A request without a row
    takes a free one, else the least recently used request's; a row that needs a page where none
    is free takes those of the least recently used rows (`grow`). A row taken from its request
    gives its pages back."""

    def __init__(self, rows: int, make: Callable[[int], R], page_tokens: int):
        self._make = make  # a fresh row of row index i
        self.page_tokens = page_tokens
        self._held: OrderedDict[str, R] = OrderedDict()
        self._free = list(range(rows))
        self._free_pages: list[int] = []
        self.evictions = 0  # rows taken from their requests

    def provide(self, pool_tokens: int, longest: int) -> int:
        """Pages for `pool_tokens` tokens, and at least for one row of `longest` positions, for the
        rows' page tables (lowest first); returns how many."""
        num_pages = max(-(-pool_tokens // self.page_tokens), -(-longest // self.page_tokens))
        self._free_pages = list(range(num_pages - 1, -1, -1))
        return num_pages

    @property
    def free_pages(self) -> int:
        return len(self._free_pages)

    def get(self, request_id: str) -> R | None:
        """The request's row (marked used), None where it holds none."""
        if request_id in self._held:
            self._held.move_to_end(request_id)
        return self._held.get(request_id)

    def take(self, request_id: str) -> R:
        """The request's row (marked used), or a new one for it."""
        row = self.get(request_id)
        if row is None:
            if not self._free:
                self._evict(keep=())
            row = self._make(self._free.pop())
            self._held[request_id] = row
        return row

    def grow(self, row: R, positions: int, keep: Collection[R]) -> bool:
        """Extend `row`'s page table until it holds `positions` positions, taking the pages of the
        least recently used rows but `row` and those in `keep` while none is free; False where
        that leaves too few (the row keeps what it had)."""
        while len(row.pages) * self.page_tokens < positions:
            if self._free_pages:
                row.pages.append(self._free_pages.pop())
            elif not self._evict(keep=(row, *keep)):
                return False
        return True

    def drop(self, row: R) -> None:
        """Give `row`'s pages back (it keeps its request)."""
        self._free_pages.extend(reversed(row.pages))
        row.pages = []

    def _evict(self, keep: Collection[R]) -> bool:
        """Take the least recently used row but those in `keep` from its request (whether there was one)."""
        victim = next((request_id for request_id, row in self._held.items() if row not in keep), None)
        if victim is None:
            return False
        row = self._held.pop(victim)
        self.drop(row)
        self._free.append(row.index)
        self.evictions += 1
        return True


def check_draft(draft: LoadedCore, target: LoadedCore) -> None:
    """ValueError naming --spec-draft-core where `draft` cannot draft for `target`: another
    vocabulary, continuation state (refused drafts could not be rolled back), a split core."""
    if draft.tokenizer.vocabulary() != target.tokenizer.vocabulary():
        raise ValueError(f"--spec-draft-core {draft.core.path}: its tokenizer's vocabulary differs from the served "
                         f"core's; a draft model must share the tokenizer")
    if draft.cache_scheme.state:
        raise ValueError(f"--spec-draft-core {draft.core.path}: its cache scheme {draft.cache_scheme.name!r} keeps "
                         f"continuation state, which cannot roll back refused drafts")
    if draft.tensor_parallel > 1:
        raise ValueError(f"--spec-draft-core {draft.core.path}: a core split over tensor-parallel ranks cannot draft")


def draft_page_bytes(draft: LoadedCore, page_tokens: int) -> int:
    """The bytes of `draft`'s records of `page_tokens` tokens (a page of the served model's pool)."""
    own = draft.capacities.page_tokens
    return -(-draft.cache_scheme.page_bytes(own) * page_tokens // own)


class DraftModel:
    samples = True  # draws a sampled request's drafts as the served model draws its tokens

    def __init__(self, draft: LoadedCore, target: LoadedCore, rows: int, longest: int, pool_tokens: int):
        """Proposals from `draft` for requests of `target` (at most `rows` live at once, each up
        to `longest` tokens with its drafts), over a pool of pages for `pool_tokens` tokens (at
        least one `longest` row; build_engine plans it beside the served model's pool, token for
        token). `draft` is one `check_draft` accepts (build_engine checks it before planning)."""
        self.page_tokens = draft.capacities.page_tokens
        self.pages_per_row = -(-longest // self.page_tokens)
        # Least recently proposing request's row reused first, its pages back to the pool.
        self.rows = RowsByRequest(rows, _Row, self.page_tokens)
        self.num_pages = self.rows.provide(pool_tokens, longest)
        self.chunk_tokens = draft.capacities.prefill_chunk_size
        self.vocab_size = target.tokenizer.vocab_size
        runner_args = dict(num_pages=self.num_pages, page_tokens=self.page_tokens, num_rows=rows,
                           num_snapshot_rows=0, num_logits_rows=0, vocab_size=draft.model_config.vocab_size,
                           device=draft.device)
        if draft.device.type == "cuda":
            from flare_core.executor.graphs import cuda_runner

            # Each draft token is one row decoding: a captured one-row decode graph replays it
            # (launched layer by layer, a small draft model's token costs as much host time as the
            # served model's whole step); its prompt chunks run eagerly (FlashInfer prefill).
            self.runner = cuda_runner(draft.model, draft.cache_scheme, **runner_args, decode_capacities=(1,),
                                      context_length=longest, dtype=draft.dtype)
        else:
            self.runner = eager_runner(draft.model, draft.cache_scheme, **runner_args)
        self._token_s = 0.0  # seconds per draft token, a moving average of the proposals so far

    def seconds(self, width: int) -> float:
        return width * self._token_s

    def propose(self, tokens: Sequence[int], width: int, request_id: str = "", draw: SamplingParams | None = None,
                step: int = 0) -> tuple[int, ...]:
        if width <= 0 or not tokens or len(tokens) + width > self.pages_per_row * self.page_tokens:
            return ()
        started = time.perf_counter()
        row = self.rows.take(request_id)
        if not self.rows.grow(row, len(tokens) + width, keep=()):  # the pool holds at least one longest row
            raise RuntimeError(f"the draft pool of {self.num_pages} pages cannot hold {len(tokens) + width} positions")
        common = 0
        for held, wanted in zip(row.tokens, tokens[:-1]):  # at least the last token is computed again
            if held != wanted:
                break
            common += 1
        handle = RequestHandle(request_id, row.index, 0)
        pages = tuple(row.pages)
        row.tokens = row.tokens[:common]  # a chunk that fails leaves the row holding only what it computed
        for start in range(common, len(tokens), self.chunk_tokens):  # the draft core's chunk size bounds a step
            end = min(start + self.chunk_tokens, len(tokens))
            chunk = PrefillChunk(handle, start, end, tuple(tokens[start:end]), pages, samples=end == len(tokens),
                                 save=None)
            logits = self.runner.run(StepPlan(0, StepKind.PREFILL, 0, (), (), (chunk,), 0.0))
            row.tokens = list(tokens[:end])
        drafts = [draft_token(logits, draw, step)]
        while len(drafts) < width and drafts[-1] < self.vocab_size:
            decode = DecodeEntry(handle, len(row.tokens), drafts[-1], pages)
            logits = self.runner.run(StepPlan(0, StepKind.DECODE, 0, (), (decode,), (), 0.0))
            row.tokens.append(drafts[-1])
            drafts.append(draft_token(logits, draw, step + len(drafts)))
        if drafts[-1] >= self.vocab_size:  # an id past the served vocabulary (a padded embedding) ends it
            drafts.pop()
        # Each proposal's host time includes its device time: every draft token is read back.
        spent = (time.perf_counter() - started) / width
        self._token_s = spent if self._token_s == 0.0 else 0.8 * self._token_s + 0.2 * spent
        return tuple(drafts)
