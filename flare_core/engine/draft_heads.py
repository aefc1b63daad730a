"""A core's draft head as a proposer for speculative decoding (`flare run CORE --spec-method mtp`):
the multi-token-prediction module a checkpoint ships beside its model (`Recipe.draft_head`,
DeepSeek V3's MTP layer) guesses each request's next tokens from the served model's final hidden
states, and the served model checks them in one round.

The head reads, at position j of a request, the served model's final hidden state h_j and token
j + 1, and keeps records of its own (one cache row of pages per live request, least recently
proposing request's row reused first). The served model hands the hidden states of every token it
computes to `record` (the eager runner's `final_hidden`); the head computes its records as soon
as the token after a position is certain (a prompt's tokens, the input of the request's next
step), so what waits is at most one step's tokens per request — unless a step's input was
sampled by a step still in flight (the host has not seen it yet): then the positions from the one
before it wait for the next proposal, which brings the request's tokens (at most WAITING_LIMIT).
A proposal computes what still waits, up to the newest sampled token, and guesses on from its own
output, drawing each guess as the draft model does (flare_core.engine.drafting.draft_token):
coupled verification keeps every output what plain decoding gives.

Positions the served model never computed (a prompt read from the prefix cache) give the head no
hidden state: its records then start at the first position it saw (`_Row.origin`), and it
attends over those only; its guesses are worse there, the outputs the same.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from flare_core.contract import CacheScheme, Recipe
from flare_core.engine.drafting import RowsByRequest, draft_token
from flare_core.executor.storage import allocate_cache_storage
from flare_core.kernels.transfer import to_device
from flare_core.ops.attention import AttentionBatch, ForwardContext
from flare_core.plugins import Registry
from flare_core.requests import SamplingParams
from flare_core.scheduler import StepPlan


# Positions whose hidden states may wait for a proposal when the host has not seen their next
# token (steps in flight) before they are dropped: at most this many hidden states a request.
WAITING_LIMIT = 64


@dataclass(eq=False)
class _Row:
    index: int
    origin: int = 0  # the position of the row's first record
    computed: int = 0  # the records hold positions [origin, computed)
    # The served model's final hidden states the head has not read yet: positions
    # [start, start + len(fed)), with the tokens the served model was fed there.
    start: int = 0
    fed: list[int] = field(default_factory=list)
    hidden: torch.Tensor | None = None
    certain: int = 0  # of them, how many were fed tokens known to be the request's (not drafts)
    pages: list[int] = field(default_factory=list)  # its page table (from `origin`), taken from the pool


def head_scheme(registry: Registry, recipe: Recipe, config: Any, dtype: str) -> CacheScheme:
    """The cache scheme of `recipe`'s draft head: the recipe's scheme built from the head's own
    config. ValueError naming --spec-method mtp where it keeps continuation state (a head's
    guesses past the next token could not be taken back)."""
    assert recipe.draft_head is not None
    scheme = registry.cache_schemes[recipe.cache_scheme].build(recipe.draft_head.config(config), dtype)
    if scheme.state:
        raise ValueError(f"--spec-method mtp: the draft head of recipe {recipe.name} keeps continuation state "
                         f"({', '.join(s.name for s in scheme.state)}), which its guesses could not roll back")
    return scheme


class HeadProposer:
    samples = True  # draws a sampled request's drafts as the served model draws its tokens

    def __init__(self, head: torch.nn.Module, scheme: CacheScheme, *, rows: int, longest: int, page_tokens: int,
                 vocab_size: int, device: torch.device, pool_tokens: int | None = None):
        """Proposals from `head` (flare_core.contract.DraftHeadModel) for at most `rows` live requests
        of up to `longest` tokens with their drafts, its records in pages of `scheme` (the head's,
        `head_scheme`); guesses at or past `vocab_size` (a padded head) end a proposal. Its pool
        of pages: `pool_tokens`, or `allocate` once the served model's is planned (build_engine)."""
        self.head = head
        self.scheme = scheme
        self.page_tokens = page_tokens
        self.pages_per_row = -(-longest // page_tokens)
        self.page_bytes = scheme.page_bytes(page_tokens)  # what plan_kv counts beside each page of the pool
        self.vocab_size = vocab_size
        self.device = device
        self.layer_map = scheme.layer_map()
        self.num_pages = 0
        self.storage: dict[str, list[torch.Tensor]] = {}
        # Least recently used request's row reused first, its pages back to the pool.
        self.rows = RowsByRequest(rows, _Row, page_tokens)
        self._token_s = 0.0  # seconds per draft token, a moving average of the proposals so far
        if pool_tokens is not None:
            self.allocate(pool_tokens)

    def allocate(self, pool_tokens: int) -> None:
        """The head's pool: pages for `pool_tokens` tokens (build_engine: as many as the served
        model's pool), at least one longest row. Each request's row takes pages as its records
        grow; where none is free, the least recently used request's row gives its pages back (its
        records then start again where the request goes on, as after a prefix-cache hit)."""
        self.num_pages = self.rows.provide(pool_tokens, self.pages_per_row * self.page_tokens)
        self.storage = allocate_cache_storage(self.scheme, self.num_pages, self.page_tokens, self.device)

    def _grow(self, row: _Row, positions: int, keep: Collection[_Row]) -> bool:
        """Pages for `row`'s records up to `positions` past its origin (RowsByRequest.grow); where
        the pool cannot give them, its records and waiting states are dropped (False)."""
        if self.rows.grow(row, positions, keep):
            return True
        self.rows.drop(row)
        row.hidden, row.fed, row.certain, row.origin, row.computed = None, [], 0, row.start, row.start
        return False

    def seconds(self, width: int) -> float:
        return width * self._token_s

    @torch.inference_mode()
    def record(self, plan: StepPlan, hidden: torch.Tensor) -> None:
        """Take the served model's final hidden states [T, hidden] of `plan`'s tokens (its decodes
        with their drafts, then its prompt chunks, as the eager runner feeds them) and compute the
        head's records of every position whose next token is now certain."""
        groups: list[tuple[str, int, list[int], int]] = []  # (request, first position, fed tokens, certain)
        for decode in plan.decodes:
            # An input the host has not seen yet (sampled by a step still running, -1 here) cannot
            # be read after the position before it: that request's waiting states are dropped.
            fed = [-1 if decode.input_token is None else decode.input_token, *decode.drafts]
            groups.append((decode.handle.request_id, decode.position, fed, 1))
        for chunk in plan.prefills:
            groups.append((chunk.handle.request_id, chunk.start, list(chunk.tokens), len(chunk.tokens)))
        work, offset = [], 0
        for request_id, first, fed, certain in groups:
            row = self.rows.take(request_id)
            step_hidden = hidden[offset:offset + len(fed)]
            offset += len(fed)
            self._take(row, first, fed, step_hidden, certain)
            # Positions before the last certain token have their next token: the head reads them
            # now where the host has seen it. An input sampled by a step still running (-1: two
            # steps in flight) holds the positions from the one before it back until a proposal
            # brings the request's tokens; past WAITING_LIMIT positions what waits is dropped.
            known = row.fed.index(-1) if -1 in row.fed else len(row.fed)
            ready = min(row.certain, known) - 1
            if ready > 0:
                work.append((row, ready, row.fed[1:ready + 1]))
            elif len(row.fed) > WAITING_LIMIT:
                row.hidden, row.fed, row.certain = None, [], 0
        if work:
            self._run(work)

    @torch.inference_mode()
    def propose(self, tokens: Sequence[int], width: int, request_id: str = "", draw: SamplingParams | None = None,
                step: int = 0) -> tuple[int, ...]:
        """Up to `width` guesses to follow `tokens` (drawn as `draft_token` draws them): the head
        first reads what waits up to the newest token (the served model computed every position
        before it), then guesses on."""
        row = self.rows.get(request_id)
        if row is None or width <= 0 or len(tokens) + width > self.pages_per_row * self.page_tokens:
            return ()
        last = len(tokens) - 1  # the newest token's position: the served model has not computed it
        if row.hidden is None or not row.start <= last - 1 < row.start + len(row.fed):
            return ()  # the hidden state at the position before the newest token never came
        started = time.perf_counter()
        ready = last - row.start
        # The fed tokens there are the request's own (a round's kept drafts); the next ones come
        # from `tokens`, which also hold the sample after the last kept one.
        outputs = self._run([(row, ready, list(tokens[row.start + 1:last + 1]))])
        if not outputs:
            return ()  # the pool could not hold its records
        hidden = outputs[0]
        drafts = [draft_token(self.head.logits(hidden[-1:]), draw, step)]
        committed = row.computed
        while len(drafts) < width and drafts[-1] < self.vocab_size:
            if not self.rows.grow(row, row.computed + 1 - row.origin, keep=()):
                break
            # Its own output stands in for the served model's hidden state one position on.
            hidden = self._forward([(row, row.computed, hidden[-1:], [drafts[-1]])])[0]
            row.computed += 1
            drafts.append(draft_token(self.head.logits(hidden), draw, step + len(drafts)))
        row.computed = committed  # the guessed positions' records are overwritten once certain
        if drafts[-1] >= self.vocab_size:
            drafts.pop()
        spent = (time.perf_counter() - started) / width
        self._token_s = spent if self._token_s == 0.0 else 0.8 * self._token_s + 0.2 * spent
        return tuple(drafts)

    def _take(self, row: _Row, first: int, fed: list[int], hidden: torch.Tensor, certain: int) -> None:
        """Add a step's tokens from `first` to what waits: what waited at or after `first` was
        computed again (a refused draft's position, a rewind), and what waited before it is now
        certain (the request went on past it); a gap drops what waited."""
        if row.hidden is not None and row.start <= first <= row.start + len(row.fed):
            keep = first - row.start
            row.fed = row.fed[:keep] + fed
            row.hidden = torch.cat([row.hidden[:keep], hidden])
            row.certain = keep + certain
        else:  # a copy: a view would keep the whole step's hidden states alive
            row.start, row.fed, row.hidden, row.certain = first, list(fed), hidden.clone(), certain

    def _run(self, work: list[tuple[_Row, int, list[int]]]) -> list[torch.Tensor]:
        """For each (row, n, next tokens): the head's records of the first n waiting positions, read
        with the tokens after them; returns each row's head hidden states [n, hidden] and drops
        those positions from what waits. A row the pool cannot hold is left out (its waiting
        states dropped, no output)."""
        batch, kept = [], []
        rows = [row for row, _, _ in work]
        for row, n, next_tokens in work:
            # Records past the first waiting position are stale (computed again); records before
            # it with a gap between are of no use: the row's records then start there.
            if not row.origin <= row.start <= row.computed:
                row.origin = row.start  # its page table now holds positions from there
            row.computed = row.start
            if not self._grow(row, row.start + n - row.origin, rows):
                continue
            batch.append((row, row.start, row.hidden[:n], next_tokens[:n]))
            kept.append((row, n, next_tokens))
        if not batch:
            return []
        outputs = self._forward(batch)
        for (row, n, _), _ in zip(kept, outputs):
            row.computed = row.start + n
            row.start += n
            row.fed = row.fed[n:]
            row.hidden = row.hidden[n:].clone()
            row.certain = max(row.certain - n, 0)
        return outputs

    def _forward(self, batch: list[tuple[_Row, int, torch.Tensor, list[int]]]) -> list[torch.Tensor]:
        """One head forward over (row, first position, previous hidden [n, hidden], tokens) groups,
        each appending records at positions first..first + n - 1 of its row; each group's output."""
        sequences, positions, tokens = [], [], []
        for row, first, previous, next_tokens in batch:
            count = len(next_tokens)
            sequences.append((count, first - row.origin, tuple(row.pages)))
            positions.extend(range(first, first + count))
            tokens.extend(next_tokens)
        context = ForwardContext(AttentionBatch.build(sequences, self.page_tokens, self.device), self.storage,
                                 layer_map=self.layer_map)
        previous = torch.cat([group[2] for group in batch])
        hidden = self.head(to_device(tokens, torch.int64, self.device), to_device(positions, torch.int64, self.device),
                           previous, context)
        return list(hidden.split([len(group[3]) for group in batch]))
