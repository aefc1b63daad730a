"""Candidate steps and their reservations: what the scheduler could run next, and the pages and
victims each would take.

`StepBuilder.candidates` proposes the possible next steps over the running requests (all decodes;
prompt chunks up to the chunk size, a starving client's first; with a mixed catalog, all decodes
plus the chunks that fill each mixed capacity beside them), each, while a client starves, with the
highest service price it leaves to the ready requests. `StepBuilder.reserve` works out what
committing one would take, changing nothing: the pages its entries would get from the KV-cache manager, oldest
request first, and the younger running requests it would preempt where pages are short. The
scheduler ranks the candidates, reserves them in rank order and commits the first that runs.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from flare_core.kv.manager import KvCacheManager
from flare_core.kv.pages import pages_for_tokens
from flare_core.scheduler.estimates import StepKind
from flare_core.scheduler.policy import Candidate, FairnessLimits, GraphCapacities, chunk_end
from flare_core.scheduler.prices import ServicePrices
from flare_core.scheduler.request import Request, RequestStatus


@dataclass(frozen=True)
class Chunk:
    """Prompt positions [start, end) of one request, proposed for the next step."""

    request: Request
    start: int
    end: int


@dataclass(frozen=True)
class CandidateStep(Candidate):
    """A candidate step with its work: the requests that decode and the chunks that prefill."""

    decoders: tuple[Request, ...] = ()
    chunks: tuple[Chunk, ...] = ()


@dataclass(eq=False)
class Reservation:
    """What committing a candidate would do: the entries that got pages (chunks possibly
    shortened), the new pages each request would take, and the requests it preempts."""

    decoders: list[Request] = field(default_factory=list)
    chunks: list[Chunk] = field(default_factory=list)
    pages: dict[str, int] = field(default_factory=dict)
    victims: list[Request] = field(default_factory=list)
    drafts: dict[str, tuple[int, ...]] = field(default_factory=dict)  # decoders' drafts that got their pages

    @property
    def runs(self) -> bool:
        return bool(self.decoders or self.chunks)


@dataclass(eq=False)
class StepBuilder:
    """Builds and reserves candidate steps for one scheduler (its catalog, chunk size, page size,
    fairness limits and service prices, its KV-cache manager)."""

    capacities: GraphCapacities
    prefill_chunk_size: int
    page_tokens: int
    fairness: FairnessLimits
    prices: ServicePrices
    kv: KvCacheManager

    def candidates(self, live: Sequence[Request], seq: int) -> list[CandidateStep]:
        """The possible next steps over the running requests: all decodes, prompt chunks up to
        the chunk size, and (with a mixed catalog) all decodes plus the chunks that fill each
        mixed capacity beside them (the smaller ones pad less, the larger carry more prompt).
        Prompt chunks go in order of submission. While a group starves (`starving`), its requests'
        chunks go first, and a decode step of its decoders alone and prompt-only steps of every
        smaller prefill capacity are proposed too, so that one client's short chat need not pay
        for another's full prompt chunk or sixty decode rows; every candidate then carries the
        highest price it leaves to the ready requests (`worst_price`)."""
        running = [r for r in live if r.status is RequestStatus.RUNNING]
        decoders = tuple(r for r in running if r.can_decode())
        prefillers = [r for r in running if r.can_prefill()]
        restoring = tuple(r for r in running if r.restore is not None)   # every plan runs their restores
        ready = (*decoders, *prefillers, *restoring)
        overdue = frozenset(r for r in running if self.fairness.overdue(seq - r.last_served_seq - 1, r.waited_s))
        starving = self.starving(ready)
        prefillers.sort(key=lambda r: (r not in starving, r.order))
        weigh = ready if starving else ()
        candidates = []
        if starving.intersection(restoring):    # their restores alone: no one else's step to wait for
            candidates.append(self.candidate((), (), weigh, overdue, restoring=restoring))
        if decoders:
            candidates.append(self.candidate(decoders, (), weigh, overdue))
            starving_decoders = tuple(r for r in decoders if r in starving)
            if 0 < len(starving_decoders) < len(decoders):     # a smaller, cheaper step of their own
                candidates.append(self.candidate(starving_decoders, (), weigh, overdue))
        packed: set[tuple[tuple[int, int], ...]] = set()
        budgets = [c for c in self.capacities.of(StepKind.PREFILL) if c < self.prefill_chunk_size] if starving else []
        for budget in [*budgets, self.prefill_chunk_size] if prefillers else ():
            chunks = self._pack(prefillers, budget)
            spans = tuple((c.start, c.end) for c in chunks)
            if chunks and spans not in packed:
                packed.add(spans)
                candidates.append(self.candidate((), chunks, weigh, overdue, deferred=len(decoders)))
        mixed: set[tuple[tuple[int, int], ...]] = set()
        for capacity in self.capacities.of(StepKind.MIXED) if decoders and prefillers else ():
            room = min(capacity - len(decoders), self.prefill_chunk_size)
            mixed_chunks = self._pack(prefillers, room) if room > 0 else ()
            spans = tuple((c.start, c.end) for c in mixed_chunks)
            if mixed_chunks and spans not in mixed:
                mixed.add(spans)
                candidates.append(self.candidate(decoders, mixed_chunks, weigh, overdue))
        return candidates

    def urgency(self, request: Request) -> float:
        """The request's price should the next full prompt chunk step leave it out."""
        return self.prices.price(request, self.prices.chunk_s(self.prefill_chunk_size))

    def starving(self, ready: Sequence[Request]) -> frozenset[Request]:
        """The ready requests of starving groups: those whose most urgent ready request is
        `starving_ratio` times as urgent as the least urgent group's, or more. Requests of one
        group never starve one another: one client's requests are served by throughput alone."""
        urgency: dict[str, float] = {}
        for request in ready:
            urgency[request.group] = max(urgency.get(request.group, 0.0), self.urgency(request))
        if len(urgency) < 2:
            return frozenset()
        floor = self.fairness.starving_ratio * min(urgency.values())
        return frozenset(r for r in ready if urgency[r.group] >= floor)

    def candidate(self, decoders: tuple[Request, ...], chunks: tuple[Chunk, ...],
                  weigh: Collection[Request] = (), overdue: Collection[Request] = (),
                  deferred: int = 0, restoring: Collection[Request] = (), drafts: int = 0) -> CandidateStep:
        """The step over `decoders` and `chunks` (and `drafts` the decoders check: a speculative
        round), leaving `deferred` ready decode rows out: its kind, the graph capacity that covers
        it, its useful tokens, the highest price it leaves to the requests in `weigh` (the
        `restoring` ones served by any step) and the `overdue` requests it serves, each computed
        here once."""
        tokens = len(decoders) + drafts + sum(c.end - c.start for c in chunks)
        kind = (StepKind.SPECULATIVE if drafts else StepKind.MIXED if decoders and chunks
                else StepKind.DECODE if decoders else StepKind.PREFILL if chunks else StepKind.RESTORE)
        capacity = 0 if kind is StepKind.RESTORE else self.capacities.covering(kind, tokens)
        assert capacity is not None, f"no {kind.value} capacity covers {tokens}"
        worst_price = 0.0
        if weigh:
            served = self.prices.served(restoring, decoders, ((c.request, c.end - c.start) for c in chunks))
            step_s = self.prices.estimator.estimate(kind, capacity)
            worst_price = max(self.prices.price(r, step_s, served.get(r, 0.0)) for r in weigh)
        served_overdue = sum(r in overdue for r in decoders) + sum(c.request in overdue for c in chunks)
        deferred_capacity = self.capacities.covering(StepKind.DECODE, deferred) or 0 if deferred else 0
        return CandidateStep(kind, capacity, tokens, served_overdue, worst_price, deferred, deferred_capacity,
                             decoders, chunks)

    def _pack(self, prefillers: list[Request], budget: int) -> tuple[Chunk, ...]:
        """Prompt chunks in the order of `prefillers`, filling `budget` tokens."""
        chunks = []
        for request in prefillers:
            if budget <= 0:
                break
            end = chunk_end(request.num_computed, request.target, budget, self.page_tokens,
                            request.boundaries)
            if end is not None:
                chunks.append(Chunk(request, request.num_computed, end))
                budget -= end - request.num_computed
        return tuple(chunks)

    def reserve(self, candidate: CandidateStep, protected: set[str], live: Sequence[Request]) -> Reservation:
        """The pages `candidate`'s entries would take, oldest request first, changing nothing: a
        decode runs only with the page for its position, a chunk is shortened to the pages it
        would get. An entry short of pages names younger running requests outside the step as
        victims (preempted only if this reservation is committed), unless pages enough return at
        the fences of steps in flight. A decoder's drafts get pages only where they are free
        (drafts beyond them are dropped): a guess never preempts anyone. Drafts ride only in steps
        without prompt chunks, up to the largest speculative capacity (rows and drafts, oldest
        request first)."""
        reservation = Reservation()
        page_tokens = self.page_tokens
        entries = [(r, r.num_computed + 1) for r in candidate.decoders] + [(c.request, c.end) for c in candidate.chunks]
        available = self.kv.obtainable(sum(max(pages_for_tokens(end, page_tokens) - len(r.kv.page_table), 0)
                                           for r, end in entries))
        granted = set(protected)
        victims: dict[str, Request] = {}
        deficit = 0
        free = self.kv.free_pages  # left once the entries have had theirs (taken free first; drafts come last)

        def take(request: Request, tokens: int) -> int:
            """Pages toward covering [0, tokens) for `request`; returns the positions covered."""
            nonlocal available, deficit, free
            held = len(request.kv.page_table)
            need = pages_for_tokens(tokens, page_tokens) - held
            got = min(max(need, 0), available)
            available -= got
            free = max(free - got, 0)
            if got:
                reservation.pages[request.request_id] = got
            if got < need:
                deficit += need - got
                self._choose_victims(request, deficit, granted, victims, live)
            return (held + got) * page_tokens

        def take_spare(request: Request, tokens: int) -> int:
            """Free pages only (none the prefix cache or a waiting request's hit would give up),
            toward covering [0, tokens); returns the positions covered."""
            nonlocal free
            held = len(request.kv.page_table) + reservation.pages.get(request.request_id, 0)
            got = min(max(pages_for_tokens(tokens, page_tokens) - held, 0), free)
            free -= got
            if got:
                reservation.pages[request.request_id] = reservation.pages.get(request.request_id, 0) + got
            return (held + got) * page_tokens

        for request in candidate.decoders:
            if request.request_id in victims:
                continue
            position = request.num_computed
            if take(request, position + 1) > position:
                reservation.decoders.append(request)
                granted.add(request.request_id)
        for chunk in candidate.chunks:
            if chunk.request.request_id in victims:
                continue
            end = min(chunk.end, take(chunk.request, chunk.end))
            if end > chunk.start:
                reservation.chunks.append(Chunk(chunk.request, chunk.start, end))
                granted.add(chunk.request.request_id)
        # Drafts last: from the free pages the step leaves, within the tokens of a speculative graph.
        tokens_left = 0 if reservation.chunks else \
            self.capacities.largest(StepKind.SPECULATIVE) - len(reservation.decoders)
        for request in reservation.decoders:
            if request.drafts and tokens_left > 0:
                position = request.num_computed
                wanted = min(len(request.drafts), tokens_left)
                room = min(take_spare(request, position + 1 + wanted) - position - 1, wanted)
                if room > 0:
                    reservation.drafts[request.request_id] = request.drafts[:room]
                    tokens_left -= room
        reservation.victims = list(victims.values())
        return reservation

    @staticmethod
    def _choose_victims(request: Request, deficit: int, granted: set[str], victims: dict[str, Request],
                        live: Sequence[Request]) -> None:
        """Add younger running requests (youngest first, not in the step) to `victims` until
        their pages, with those returning at in-flight fences, cover `deficit`."""
        returning = pages_awaiting_fence(live) + sum(len(v.kv.page_table) for v in victims.values())
        for victim in reversed(live):
            if returning >= deficit:
                return
            if (victim.status is RequestStatus.RUNNING and victim.order > request.order
                    and victim.request_id not in granted and victim.request_id not in victims
                    and victim.num_planned_samples < victim.max_tokens):
                victims[victim.request_id] = victim
                returning += len(victim.kv.page_table)


def pages_awaiting_fence(live: Sequence[Request]) -> int:
    """Pages of requests no longer running that return at the fence of a step in flight."""
    return sum(len(r.kv.page_table) for r in live if r.status is not RequestStatus.RUNNING and r.in_flight > 0)
