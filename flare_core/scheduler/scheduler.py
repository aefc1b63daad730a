"""The Scheduler: admission, step plans, completion, preemption, cancellation.

One call to `schedule()` returns the next `StepPlan` (or None when nothing can run); the
executor runs it and hands back a `StepResult` through `complete()`. Plans may be issued before
earlier ones complete (the GPU path keeps two in flight), so request state advances when a plan
is issued and is confirmed, in issue order, when it completes. Resources of a finished,
cancelled or preempted request are released at the completion of the last in-flight plan that
includes it (its fence), never earlier.

Pages. Everything a request holds in the cache (pages, state row, prefix hit, resume points)
goes through the KV-cache manager (flare_core.kv.manager). Pages are taken when a step needs
them; when none are free the prefix cache evicts, and if that is not enough an older request
preempts the youngest running ones (their pages return at their fence; they requeue and
recompute, reusing whatever the prefix cache kept).
"""

from __future__ import annotations

import bisect
import math
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from flare_core.kv.manager import KvCacheManager
from flare_core.kv.pages import request_page_need
from flare_core.kv.prefix import NO_HIT, ResumeStorage
from flare_core.requests import SamplingParams
from flare_core.scheduler.estimates import StepCostEstimator, StepKind
from flare_core.scheduler.policy import FairnessLimits, GraphCapacities, chunk_end, rank
from flare_core.scheduler.prices import ServicePrices
from flare_core.scheduler.proposals import Proposer
from flare_core.scheduler.speculation import Speculation
from flare_core.scheduler.request import Request, RequestHandle, RequestStatus, Restore
from flare_core.scheduler.steps import Reservation, StepBuilder


@dataclass(frozen=True)
class SchedulerConfig:
    max_concurrency: int
    prefill_chunk_size: int
    capacities: GraphCapacities
    page_tokens: int = 64
    fairness: FairnessLimits = field(default_factory=FairnessLimits)
    max_live_per_client: int | None = None  # live requests one client address may hold (None: no cap)
    # Speculative decoding: up to `draft_tokens` tokens `proposer` guesses, checked in a request's
    # decode row (0: off). With `continuation_state` (the cache keeps some per request row), a
    # round that refuses drafts is computed again up to what it kept (scheduler.speculation).
    proposer: Proposer | None = None
    draft_tokens: int = 0
    continuation_state: bool = False

    def __post_init__(self) -> None:
        if self.max_concurrency < 1:
            raise ValueError(f"SchedulerConfig max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.page_tokens < 1:
            raise ValueError(f"SchedulerConfig page_tokens must be >= 1, got {self.page_tokens}")
        if self.draft_tokens < 0 or (self.draft_tokens > 0) != (self.proposer is not None):
            raise ValueError(f"SchedulerConfig draft_tokens ({self.draft_tokens}) must be >= 0, and > 0 exactly "
                             f"when a proposer is given")
        if self.max_live_per_client is not None and self.max_live_per_client < 1:
            raise ValueError(f"SchedulerConfig max_live_per_client must be >= 1, got {self.max_live_per_client}")
        if self.prefill_chunk_size < self.page_tokens or self.prefill_chunk_size % self.page_tokens:
            raise ValueError(f"SchedulerConfig prefill_chunk_size ({self.prefill_chunk_size}) must be a "
                             f"positive multiple of page_tokens ({self.page_tokens})")
        if self.capacities.largest(StepKind.DECODE) < self.max_concurrency:
            raise ValueError(f"the largest decode capacity ({self.capacities.largest(StepKind.DECODE)}) "
                             f"must cover max_concurrency ({self.max_concurrency})")
        if self.capacities.largest(StepKind.PREFILL) < self.prefill_chunk_size:
            raise ValueError(f"the largest prefill capacity ({self.capacities.largest(StepKind.PREFILL)}) "
                             f"must cover prefill_chunk_size ({self.prefill_chunk_size})")


@dataclass(frozen=True)
class DecodeEntry:
    """Feed one token at `position` and sample the next. With `drafts` (speculative decoding),
    feed them too, at position + 1 on, and sample after each: `complete` keeps the drafts the
    samples confirm (sample i equal to draft i) and the sample after the last one kept."""

    handle: RequestHandle
    position: int
    input_token: int | None         # None: the token sampled for this state row by the previous plan (on device)
    page_table: tuple[int, ...]
    drafts: tuple[int, ...] = ()    # only with a known input_token


@dataclass(frozen=True)
class PrefillChunk:
    """Compute positions [start, end) from `tokens`. A chunk with start == 0 begins from a zeroed
    state row; otherwise the row continues (or was restored by this plan's Restore). If
    `samples`, sample the next token from the logits at end-1. If `save` is set, after the
    chunk: copy page_table[end // page_tokens] to save.tail_page, the state row handle.state_row to
    save.snapshot_row, and the logits at end-1 to save.logits_row (each only when not None).
    With `rewind`, the state row starts as it was before the request's last speculative round
    (the chunk computes again, from the round's first position, what the round kept)."""

    handle: RequestHandle
    start: int
    end: int
    tokens: tuple[int, ...]
    page_table: tuple[int, ...]
    samples: bool
    save: ResumeStorage | None
    # Prompt tokens the chunk's rows predict, for requests that score their prompt: the logits at
    # start + i give the logprob of prompt_targets[i] (the prompt token at start + i + 1).
    prompt_targets: tuple[int, ...] = ()
    rewind: bool = False


@dataclass(frozen=True)
class StepPlan:
    """One step for the executor. Run `restores` first, then one graph of `kind` padded to
    `capacity` over `decodes` and `prefills`. `samples` orders the tokens of the StepResult."""

    seq: int
    kind: StepKind
    capacity: int
    restores: tuple[Restore, ...]
    decodes: tuple[DecodeEntry, ...]
    prefills: tuple[PrefillChunk, ...]
    estimated_s: float

    @property
    def drafts_of(self) -> dict[RequestHandle, tuple[int, ...]]:
        """The drafts of its decodes that check some, by request handle."""
        return {d.handle: d.drafts for d in self.decodes if d.drafts}

    @property
    def prompt_tokens(self) -> int:
        """The tokens of its prompt chunks."""
        return sum(c.end - c.start for c in self.prefills)

    @property
    def fed_tokens(self) -> int:
        """The tokens the step feeds the model: each decode's input and drafts, then its prompt
        chunks' tokens (in this order on every executor; a graph pads after them)."""
        return sum(1 + len(d.drafts) for d in self.decodes) + self.prompt_tokens

    @property
    def samples(self) -> tuple[RequestHandle, ...]:
        """Restores with stored logits, then decodes (a decode with drafts once per position it
        samples), then sampling prefill chunks."""
        return (tuple(r.handle for r in self.restores if r.logits_row is not None)
                + tuple(d.handle for d in self.decodes for _ in range(1 + len(d.drafts)))
                + tuple(p.handle for p in self.prefills if p.samples))


@dataclass(frozen=True)
class StepResult:
    tokens: Sequence[int]   # one sampled token per plan.samples entry, in that order
    duration_s: float       # measured wall time of the step


@dataclass(frozen=True)
class SampledToken:
    handle: RequestHandle
    token: int
    row: int  # its row of the step's samples (plan.samples order)


@dataclass(frozen=True)
class Resources:
    """What requests and the prefix cache hold at one moment: the view `/metrics`, the
    dashboard and tests read (each count is cheap to take)."""

    live: int                   # requests holding a state row
    waiting: int                # requests queued for one
    steps_in_flight: int        # issued plans not completed yet
    state_rows: int
    free_state_rows: int
    pages: int
    free_pages: int
    cached_pages: int           # pages the prefix cache holds
    request_page_refs: int      # references held on pages by anything but the cache (page tables,
    #                             hits held by waiting requests, reserved resume point copies)
    preemptions: int            # requests preempted so far (for pages, or for a starving waiting request)
    drafts: int = 0             # draft tokens checked so far (speculative decoding)
    accepted_drafts: int = 0    # of them, those the target model's samples confirmed
    draft_rounds: int = 0       # decode rows that checked drafts
    draft_widths: tuple[int, ...] = ()  # of them, by how many drafts they checked (index: drafts)


def _check_submission(request_id: str, prompt: tuple[int, ...], max_tokens: int, message_ends: tuple[int, ...],
                      pages: int, cache_pages: int) -> None:
    """ValueError naming what of a submitted request the scheduler cannot take (`pages`: what it
    needs at most; `cache_pages`: the pool's)."""
    if not prompt:
        raise ValueError(f"request {request_id!r}: prompt must hold at least one token")
    if max_tokens < 1:
        raise ValueError(f"request {request_id!r}: max_tokens must be >= 1, got {max_tokens}")
    ends = list(message_ends)
    if ends != sorted(set(ends)) or (ends and (ends[0] < 1 or ends[-1] > len(prompt))):
        raise ValueError(f"request {request_id!r}: message_ends must be increasing endpoints in "
                         f"1..{len(prompt)}, got {message_ends}")
    if pages > cache_pages:
        raise ValueError(f"request {request_id!r} needs {pages} pages (prompt {len(prompt)} + "
                         f"max_tokens {max_tokens}) but the cache has {cache_pages}")


def _boundaries(kv: KvCacheManager, request: Request, start: int, target: int) -> tuple[int, ...]:
    """Chunk ends forced so a state snapshot can be taken exactly there."""
    if not kv.continuation_state:
        return ()
    ends = set(request.message_ends)
    ends.add(request.prompt_len)
    return tuple(sorted(e for e in ends if start < e < target))


def _reserve_save(kv: KvCacheManager, request: Request, end: int) -> ResumeStorage | None:
    """The resume point a chunk ending at `end` saves: at the prompt's end or a forced boundary."""
    prompt_end = end == request.prompt_len
    if not prompt_end and end not in request.boundaries:
        return None
    return kv.reserve_resume_point(request.request_id, request.prompt, end, prompt_end)


def _prefill_chunk(kv: KvCacheManager, request: Request, start: int, end: int) -> PrefillChunk:
    """The chunk [start, end) of `request`: it samples where it ends the request's target, saves
    a resume point where one is due, rewinds where the request's last round asks for it."""
    assert request.handle is not None, "a running request holds a state row"
    targets = request.prompt[start + 1:end + 1] if request.score_prompt else ()
    return PrefillChunk(request.handle, start, end, request.tokens_between(start, end), request.kv.page_table,
                        end == request.target, _reserve_save(kv, request, end), targets, rewind=request.rewinds)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KvCacheManager, estimator: StepCostEstimator | None = None) -> None:
        if kv.page_tokens != config.page_tokens:
            raise ValueError(f"the KV-cache manager's page_tokens ({kv.page_tokens}) must equal the "
                             f"scheduler's ({config.page_tokens})")
        if kv.state_rows != config.max_concurrency:
            raise ValueError(f"the KV-cache manager's state rows ({kv.state_rows}) must equal max_concurrency "
                             f"({config.max_concurrency})")
        self.config = config
        self.kv = kv
        self.estimator = estimator or StepCostEstimator()
        self.prices = ServicePrices(self.estimator, config.capacities, config.prefill_chunk_size,
                                    config.fairness.memory_s)
        self._steps = StepBuilder(config.capacities, config.prefill_chunk_size, config.page_tokens, config.fairness,
                                  self.prices, kv)
        self._requests: dict[str, Request] = {}
        self._waiting: list[Request] = []               # queued for a state row
        self._promised: Request | None = None           # a waiting request another gave its row up for
        self._live: list[Request] = []                  # holding a state row, sorted by order
        self._in_flight: deque[tuple[StepPlan, list[Request]]] = deque()
        self._next_seq = 0
        self._next_order = 0
        self.preemptions = 0    # requests preempted so far (a metric)
        self.speculation = Speculation.of(config, self.estimator)

    # ---- requests -----------------------------------------------------------------------

    def submit(self, request_id: str, prompt: Sequence[int], max_tokens: int,
               message_ends: Sequence[int] = (), score_prompt: bool = False, group: str | None = None,
               client: str = "", draw: SamplingParams | None = None) -> None:
        """Queue a request. `marks` are message-boundary token endpoints within the prompt
        (resume point candidates). With `score_prompt` every prompt position is computed (no prefix
        reuse) and its chunks carry their prompt targets. Requests of one `group` (the engine's:
        one client address; default: the request alone) share their service price; `client` (an
        address) is what the cap on live requests per client counts. With a proposer configured,
        its decode rows check draft tokens; `draw`: how its tokens are sampled, for a proposer that
        samples its drafts. The caller has already checked the context limit."""
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already known to the scheduler")
        prompt, message_ends = tuple(prompt), tuple(message_ends)
        _check_submission(request_id, prompt, max_tokens, message_ends,
                          request_page_need(len(prompt), max_tokens, self.config.page_tokens), self.kv.num_pages)
        request = Request(request_id, prompt, max_tokens, message_ends, self._next_order, score_prompt=score_prompt,
                          group=group or request_id, client=client, kv=self.kv.open(request_id),
                          speculate=self.config.proposer is not None, draw=draw)
        self._next_order += 1
        self._requests[request_id] = request
        self.prices.join(request)
        self._waiting.append(request)

    def finish(self, request_id: str, reason: str) -> None:
        """Stop scheduling a request now; its state row and pages return at its fence. Tokens still
        produced by in-flight plans for it are dropped."""
        request = self._requests.get(request_id)
        if request is None:
            raise KeyError(f"unknown request_id {request_id!r}")
        if request.status is RequestStatus.STOPPED:
            return
        was_waiting = request.status is RequestStatus.WAITING
        request.status = RequestStatus.STOPPED
        request.finish_reason = reason
        if was_waiting:
            self._forget(request)
        elif request.in_flight == 0:
            self._release(request)

    def cancel(self, request_id: str) -> bool:
        """finish(request_id, "cancelled"); False if the request is unknown or already stopped."""
        request = self._requests.get(request_id)
        if request is None or request.status is RequestStatus.STOPPED:
            return False
        self.finish(request_id, "cancelled")
        return True

    def request(self, request_id: str) -> Request:
        """The scheduler's state for a request (read it, do not modify it)."""
        try:
            return self._requests[request_id]
        except KeyError:
            raise KeyError(f"unknown request_id {request_id!r}") from None

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_live(self) -> int:
        return len(self._live)

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def is_idle(self) -> bool:
        return not self._requests and not self._in_flight

    def has_request(self, request_id: str) -> bool:
        """Whether `request_id` is queued, running, or stopped with a plan still in flight."""
        return request_id in self._requests

    def resources(self) -> Resources:
        kv = self.kv
        return Resources(live=self.num_live, waiting=self.num_waiting, steps_in_flight=len(self._in_flight),
                         state_rows=kv.state_rows, free_state_rows=kv.free_state_rows, pages=kv.num_pages,
                         free_pages=kv.free_pages, cached_pages=kv.cached_pages,
                         request_page_refs=kv.request_page_refs, preemptions=self.preemptions,
                         **self.speculation.counts())

    # ---- planning -----------------------------------------------------------------------
    #
    # `schedule` builds the candidate steps (decode, prefill, mixed), ranks them, and for each in
    # turn `_reserve`s pages without changing anything: the first reservation that runs
    # something is committed (`_commit` preempts its victims, takes its pages, advances the
    # requests and records the plan); the others cost nothing. When no candidate can run, the
    # best-ranked one's victims are preempted and the candidates built again, so an older
    # request always gets the pages it needs, and a rejected candidate preempts nothing.

    def schedule(self) -> StepPlan | None:
        """Admit what fits, choose the next step and issue it; None when nothing can run now."""
        seq = self._next_seq
        self.prices.refresh()
        self._admit()
        restoring = [r for r in self._live if r.status is RequestStatus.RUNNING and r.restore is not None]
        protected = {r.request_id for r in restoring}  # their restore runs in this plan
        self.speculation.propose(self._live)
        while True:
            candidates = self._steps.candidates(self._live, seq)
            blocked: Reservation | None = None
            for index in rank(candidates, self.estimator):
                if candidates[index].kind is StepKind.RESTORE:
                    return self._commit(seq, restoring, Reservation())     # restores alone
                reservation = self._steps.reserve(candidates[index], protected, self._live)
                if reservation.runs:
                    return self._commit(seq, restoring, reservation)
                blocked = blocked or (reservation if reservation.victims else None)
            if blocked is None:
                break
            for victim in blocked.victims:  # their pages return now, or at their fence
                self._preempt(victim)
        return self._commit(seq, restoring, Reservation()) if restoring else None   # restores alone

    def _commit(self, seq: int, restoring: list[Request], reservation: Reservation) -> StepPlan:
        """Issue `reservation` as plan `seq`: preempt its victims, append its pages, advance its
        requests' state and record the plan as in flight."""
        for victim in reservation.victims:
            self._preempt(victim)
        self.kv.extend(reservation.pages)
        self.speculation.placed(reservation.decoders, reservation.drafts)
        decodes = []
        for request in reservation.decoders:
            position = request.num_computed
            assert request.handle is not None, "a running request holds a state row"
            drafts = reservation.drafts.get(request.request_id, ())
            decodes.append(DecodeEntry(request.handle, position, request.token_at(position), request.kv.page_table,
                                       drafts))
            request.num_computed += 1 + len(drafts)
            request.num_planned_samples += 1 + len(drafts)
            request.verifying = bool(drafts)
        prefills = []
        for chunk in reservation.chunks:
            prefills.append(_prefill_chunk(self.kv, chunk.request, chunk.start, chunk.end))
            chunk.request.num_computed = chunk.end
            chunk.request.num_planned_samples += prefills[-1].samples
            chunk.request.rewinds = False
        restores = []
        for request in restoring:
            restore = request.restore
            assert restore is not None
            restores.append(restore)
            if restore.logits_row is not None:
                request.num_planned_samples += 1
            request.restore = None

        step = self._steps.candidate(tuple(reservation.decoders), tuple(reservation.chunks),
                                     drafts=sum(len(d) for d in reservation.drafts.values()))
        plan = StepPlan(seq, step.kind, step.capacity, tuple(restores), tuple(decodes), tuple(prefills),
                        self.estimator.estimate(step.kind, step.capacity))
        members = {r.request_id: r for r in [*restoring, *reservation.decoders,
                                             *(c.request for c in reservation.chunks)]}
        self.prices.advance(plan.estimated_s, self.prices.served(
            restoring, reservation.decoders, ((c.request, c.end - c.start) for c in reservation.chunks)))
        for request in self._live:
            if request.request_id in members:
                request.last_served_seq = seq
                request.waited_s = 0.0
            elif request.status is RequestStatus.RUNNING:
                request.waited_s += plan.estimated_s
        for request in members.values():
            request.in_flight += 1
        self._in_flight.append((plan, list(members.values())))
        self._next_seq += 1
        return plan

    # ---- completion ---------------------------------------------------------------------

    def complete(self, plan: StepPlan, result: StepResult) -> list[SampledToken]:
        """Confirm the oldest in-flight plan: record its sampled tokens and measured duration,
        register cache pages and resume points it produced, and release requests whose fence it
        was. Returns the tokens of requests still running (or preempted, which keep them)."""
        if not self._in_flight or self._in_flight[0][0] is not plan:
            expected = self._in_flight[0][0].seq if self._in_flight else None
            raise ValueError(f"complete() takes in-flight plans in issue order: expected seq {expected}, "
                             f"got seq {plan.seq}")
        samples = plan.samples
        if len(result.tokens) != len(samples):
            raise ValueError(f"StepResult for plan {plan.seq} has {len(result.tokens)} tokens; "
                             f"the plan samples {len(samples)}")
        self.estimator.observe(plan.kind, plan.capacity, result.duration_s)
        _, members = self._in_flight.popleft()

        for restore in plan.restores:
            self.kv.restored(restore.handle.request_id)
        for chunk in plan.prefills:
            request = self._requests[chunk.handle.request_id]
            request.num_written = max(request.num_written, chunk.end)
            if chunk.save is not None:
                self.kv.save(request.request_id, request.prompt, chunk.end, chunk.save)
        for decode in plan.decodes:
            request = self._requests[decode.handle.request_id]
            request.num_written = max(request.num_written, decode.position + 1)

        dropped = self.speculation.settle(plan, result.tokens, self.request)
        emitted = []
        for row, (handle, token) in enumerate(zip(samples, result.tokens)):
            request = self._requests[handle.request_id]
            if row not in dropped and request.status in (RequestStatus.RUNNING, RequestStatus.PREEMPTED):
                request.outputs.append(token)
                emitted.append(SampledToken(handle, token, row))

        for request in members:
            self.kv.cache_written(request.request_id, request, request.num_written)
            request.in_flight -= 1
            if request.in_flight == 0 and request.status in (RequestStatus.PREEMPTED, RequestStatus.STOPPED):
                self._release(request)
        return emitted

    # ---- admission, pages, release ------------------------------------------------------

    def _admit(self) -> None:
        """Admit waiting requests while a state row and the pages for their first chunk (plus one
        page of headroom per running request) are available: the one another gave its row up
        for first, then those that gave theirs up, then the starving ones, then in order of
        submission, a client at its cap on live requests passed over. With every row taken, a
        starving waiting request takes the row of the live request of the lowest urgency
        (see `_yield_row`)."""
        page_tokens = self.config.page_tokens
        while self._waiting:
            floor = self._starving_floor()
            request = self._next_waiting(floor)
            if request is None:
                return
            if not self.kv.free_state_rows and not (self._yield_row(request, floor) and self.kv.free_state_rows):
                return
            tokens = request.known_tokens()
            hit = NO_HIT if request.score_prompt else self.kv.lookup(request.request_id, tokens)
            target = len(tokens)
            boundaries = _boundaries(self.kv, request, hit.num_tokens, target)
            end = target if hit.exact else chunk_end(hit.num_tokens, target, self.config.prefill_chunk_size,
                                                     page_tokens, boundaries)
            assert end is not None, "a request short of its target has a next chunk"
            first_end = end
            headroom = sum(1 for r in self._live if r.status is RequestStatus.RUNNING)
            admission = self.kv.admit(request.request_id, first_end, headroom)
            if admission is None:
                return
            self._waiting.remove(request)
            if request is self._promised:
                self._promised = None
            request.handle = RequestHandle(request.request_id, admission.state_row, admission.generation)
            request.target = target
            request.boundaries = boundaries
            request.num_computed = request.num_written = admission.restored_tokens
            request.num_planned_samples = len(request.outputs)
            if admission.resumes:
                request.restore = Restore(request.handle, admission.tail_copy, admission.snapshot_row,
                                          admission.logits_row)
            request.status = RequestStatus.RUNNING
            request.last_served_seq = self._next_seq - 1
            request.waited_s = 0.0
            bisect.insort(self._live, request, key=lambda r: r.order)

    def _next_waiting(self, floor: float) -> Request | None:
        """The waiting request to admit next (`floor`: the urgency from which one starves), or
        None when every one's client is at its cap."""
        cap = self.config.max_live_per_client
        live = Counter(r.client for r in self._live) if cap is not None else Counter()
        allowed = [r for r in self._waiting if cap is None or not r.client or live[r.client] < cap]
        if not allowed:
            return None
        return max(allowed, key=lambda r: (r is self._promised, r.yielded, self._steps.urgency(r) >= floor, -r.order))

    def _starving_floor(self) -> float:
        """The urgency from which a waiting request starves: `starving_ratio` times the lower
        median of the running requests' (infinite when none runs)."""
        urgencies = sorted(self._steps.urgency(r) for r in self._live if r.status is RequestStatus.RUNNING)
        if not urgencies:
            return math.inf
        return self.config.fairness.starving_ratio * urgencies[(len(urgencies) - 1) // 2]

    def _yield_row(self, request: Request, floor: float) -> bool:
        """Every state row is taken: if `request` starves against the live requests (its urgency
        at `floor`, `starving_ratio` times their lower median's, or more), the running request of
        the lowest urgency that has not yielded before gives its row up (preempted: its pages
        return at its fence, what it computed stays in the prefix cache, and it is admitted again
        first). Only with a prefix cache (without one, the preempted request would compute
        everything again), and one row at a time. Whether a row was given up."""
        if (self.kv.prefix_stats is None or self._promised is not None
                or any(r.status is RequestStatus.PREEMPTED for r in self._live)):
            return False
        if self._steps.urgency(request) < floor:
            return False
        victims = [r for r in self._live if r.status is RequestStatus.RUNNING and not r.yielded
                   and r.group != request.group and r.restore is None and r.num_planned_samples < r.max_tokens]
        if not victims:
            return False
        victim = min(victims, key=lambda r: (self._steps.urgency(r), -r.order))
        victim.yielded = True
        self._promised = request
        self._preempt(victim)
        return True

    def _preempt(self, request: Request) -> None:
        request.status = RequestStatus.PREEMPTED
        self.preemptions += 1
        if request.in_flight == 0:
            self._release(request)

    def _release(self, request: Request) -> None:
        """Return a request's state row and pages (its fence has passed)."""
        assert request.handle is not None and request.in_flight == 0
        self.kv.release(request.request_id, request, request.num_written)
        self._live.remove(request)
        request.reset_admission()
        if request.status is RequestStatus.PREEMPTED:
            request.status = RequestStatus.WAITING
            self._waiting.append(request)
        else:
            self._forget(request)

    def _forget(self, request: Request) -> None:
        if request.status is RequestStatus.STOPPED and request in self._waiting:
            self._waiting.remove(request)
        if request is self._promised:
            self._promised = None
        del self._requests[request.request_id]
        self.prices.leave(request)
        self.kv.close(request.request_id)
