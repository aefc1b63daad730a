"""Serving telemetry for the terminal dashboard: step buckets, token throughput, request phases.

The engine's model thread reports into a `Telemetry` only when the dashboard is on (the engine
holds `telemetry: Telemetry | None`, so the off path costs one `if` per step). The event loop
reads consistent copies through `snapshot()`. One lock guards everything: the model thread
holds it for a few dict updates per step, the reader for one copy per redraw.

Step buckets are keyed by (kind, capacity): on the GPU path these are the captured graph catalog
entries a step replays, on the eager path the capacities the scheduler planned for.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from flare_core.engine.stats import Activity

QUEUED = "queued"
PREFILL = "prefill"
DECODE = "decode"
FINISHED = "finished"

# Finish reasons of the runtime that count as completions (the others: "cancelled", "error").
_COMPLETED_REASONS = ("stop", "length")


@dataclass(frozen=True)
class StepBucket:
    """Steps of one (kind, capacity): how often they ran and how long they took."""

    kind: str
    capacity: int
    calls: int
    total_s: float
    max_s: float

    @property
    def mean_s(self) -> float:
        return self.total_s / self.calls if self.calls else 0.0


@dataclass(frozen=True)
class RequestRow:
    """One request as the dashboard shows it; times are `time.monotonic()`-style seconds."""

    request_id: str
    phase: str                      # QUEUED, PREFILL, DECODE or FINISHED
    prompt_tokens: int
    cached_tokens: int              # prompt tokens restored from the prefix cache
    generated_tokens: int
    submitted_at: float
    first_token_at: float | None
    last_token_at: float | None
    max_gap_s: float                # longest time between two consecutive tokens
    finish_reason: str | None


@dataclass(frozen=True)
class PageCounts:
    total: int
    free: int
    cached: int                     # pages held by the prefix cache (some also in live page tables)


@dataclass(frozen=True)
class DraftCounts:
    """Speculative decoding so far: decode rows that checked drafts, drafts checked, drafts kept,
    and the rows by how many drafts they checked (index: drafts)."""

    rounds: int
    drafts: int
    kept: int
    widths: tuple[int, ...] = ()


@dataclass(frozen=True)
class TelemetrySnapshot:
    taken_at: float
    started_at: float
    window_s: float                 # throughput is averaged over the last `window_s` seconds
    prefill_rate: float             # prompt tokens computed per second
    generation_rate: float          # tokens generated per second
    prefill_tokens: int             # totals since start
    generated_tokens: int
    steps: int
    queued: int
    active: int                     # in prefill or decode
    completed: int
    cancelled: int
    failed: int
    prompt_tokens: int              # prompt tokens of requests that started work
    reused_tokens: int              # of those, restored from the prefix cache
    pages: PageCounts | None
    buckets: tuple[StepBucket, ...]  # by kind, then capacity
    requests: tuple[RequestRow, ...]  # live ones in submission order, then finished ones, newest first
    drafts: DraftCounts | None = None  # None: no row checked drafts yet


@dataclass
class _Request:
    prompt_tokens: int
    submitted_at: float
    phase: str = QUEUED
    cached_tokens: int = 0
    generated: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    max_gap_s: float = 0.0
    finish_reason: str | None = None

    def row(self, request_id: str) -> RequestRow:
        return RequestRow(request_id, self.phase, self.prompt_tokens, self.cached_tokens, self.generated,
                          self.submitted_at, self.first_token_at, self.last_token_at, self.max_gap_s,
                          self.finish_reason)


@dataclass
class _Bucket:
    calls: int = 0
    total_s: float = 0.0
    max_s: float = 0.0


class Telemetry:
    """Aggregates what the model thread reports; `snapshot()` may be called from any thread."""

    def __init__(self, *, window_s: float = 5.0, keep_finished: int = 32,
                 clock: Callable[[], float] = time.monotonic):
        if window_s <= 0:
            raise ValueError(f"Telemetry window_s must be > 0, got {window_s}")
        if keep_finished < 0:
            raise ValueError(f"Telemetry keep_finished must be >= 0, got {keep_finished}")
        self._clock = clock
        self._window_s = window_s
        self._lock = threading.Lock()
        self._started_at = clock()
        self._buckets: dict[tuple[str, int], _Bucket] = {}
        self._recent: deque[tuple[float, int, int]] = deque()  # (time, prefill tokens, generated) per step
        self._live: dict[str, _Request] = {}
        self._finished: deque[tuple[str, _Request]] = deque(maxlen=keep_finished)
        self._prefill_tokens = 0
        self._generated_tokens = 0
        self._steps = 0
        self._finish_counts = {"completed": 0, "cancelled": 0, "failed": 0}
        self._prompt_tokens = 0
        self._reused_tokens = 0
        self._pages: PageCounts | None = None
        self._drafts: DraftCounts | None = None

    # ---- model thread ------------------------------------------------------------------------

    def record(self, activity: Activity) -> None:
        """Take what the engine core reported (flare_core.engine.stats.Activity), in its order:
        requests queued and started, steps read back, requests finished."""
        for request_id, prompt_tokens in activity.queued:
            self.request_queued(request_id, prompt_tokens)
        for request_id, cached_tokens in activity.started:
            self.request_started(request_id, cached_tokens)
        resources = activity.resources
        assert resources is not None, "an engine core's report holds its resources"
        pages = {"total_pages": resources.pages, "free_pages": resources.free_pages,
                 "cached_pages": resources.cached_pages}
        for step in activity.steps:
            self.record_step(step.kind, step.capacity, step.duration_s, prefill_tokens=step.prefill_tokens,
                             sampled=step.sampled, **pages)
        for finished in activity.finished:
            self.request_finished(finished.request_id, finished.reason, **pages)
        if resources.draft_rounds:
            self.record_drafts(resources.draft_rounds, resources.drafts, resources.accepted_drafts,
                               resources.draft_widths)

    def record_drafts(self, rounds: int, drafts: int, kept: int, widths: tuple[int, ...] = ()) -> None:
        """Speculative decoding's totals so far (decode rows that checked drafts, drafts, kept, rows
        by their drafts)."""
        with self._lock:
            self._drafts = DraftCounts(rounds, drafts, kept, widths)

    def request_queued(self, request_id: str, prompt_tokens: int) -> None:
        with self._lock:
            self._live[request_id] = _Request(prompt_tokens, self._clock())

    def request_started(self, request_id: str, cached_tokens: int) -> None:
        """The request's first prefill chunk or prefix restore ran; `cached_tokens` were reused."""
        with self._lock:
            request = self._live.get(request_id)
            if request is None or request.phase != QUEUED:
                return
            request.phase = PREFILL
            request.cached_tokens = cached_tokens
            self._prompt_tokens += request.prompt_tokens
            self._reused_tokens += cached_tokens

    def record_step(self, kind: str, capacity: int, duration_s: float, *, prefill_tokens: int,
                    sampled: Sequence[str], total_pages: int, free_pages: int, cached_pages: int) -> None:
        """One executed step of bucket (kind, capacity). `sampled` names the request of each token
        it produced; tokens of requests already finished (cancelled meanwhile) are not counted."""
        now = self._clock()
        with self._lock:
            bucket = self._buckets.get((kind, capacity))
            if bucket is None:
                bucket = self._buckets[(kind, capacity)] = _Bucket()
            bucket.calls += 1
            bucket.total_s += duration_s
            bucket.max_s = max(bucket.max_s, duration_s)
            generated = 0
            for request_id in sampled:
                request = self._live.get(request_id)
                if request is None:
                    continue
                generated += 1
                request.generated += 1
                request.phase = DECODE
                if request.last_token_at is None:
                    request.first_token_at = now
                else:
                    request.max_gap_s = max(request.max_gap_s, now - request.last_token_at)
                request.last_token_at = now
            self._steps += 1
            self._prefill_tokens += prefill_tokens
            self._generated_tokens += generated
            self._recent.append((now, prefill_tokens, generated))
            self._trim(now)
            self._pages = PageCounts(total_pages, free_pages, cached_pages)

    def request_finished(self, request_id: str, reason: str, *, total_pages: int, free_pages: int,
                         cached_pages: int) -> None:
        """`reason`: "stop" or "length" (completed), "cancelled", or "error" (failed)."""
        if reason in _COMPLETED_REASONS:
            outcome = "completed"
        elif reason == "cancelled":
            outcome = "cancelled"
        elif reason == "error":
            outcome = "failed"
        else:
            raise ValueError(f"request_finished: unknown finish reason {reason!r} "
                             f"(expected one of {_COMPLETED_REASONS + ('cancelled', 'error')})")
        with self._lock:
            self._finish_counts[outcome] += 1
            self._pages = PageCounts(total_pages, free_pages, cached_pages)
            request = self._live.pop(request_id, None)
            if request is None:  # rejected before it was queued
                return
            request.phase = FINISHED
            request.finish_reason = reason
            self._finished.append((request_id, request))

    # ---- readers -----------------------------------------------------------------------------

    def snapshot(self) -> TelemetrySnapshot:
        now = self._clock()
        with self._lock:
            self._trim(now)
            # Until a whole window has passed, average over the time since start.
            span = max(min(self._window_s, now - self._started_at), 1e-9)
            prefill_rate = sum(entry[1] for entry in self._recent) / span
            generation_rate = sum(entry[2] for entry in self._recent) / span
            buckets = tuple(StepBucket(kind, capacity, b.calls, b.total_s, b.max_s)
                            for (kind, capacity), b in sorted(self._buckets.items()))
            live = [r.row(request_id) for request_id, r in self._live.items()]
            finished = [r.row(request_id) for request_id, r in reversed(self._finished)]
            queued = sum(1 for row in live if row.phase == QUEUED)
            return TelemetrySnapshot(
                taken_at=now, started_at=self._started_at, window_s=self._window_s,
                prefill_rate=prefill_rate, generation_rate=generation_rate,
                prefill_tokens=self._prefill_tokens, generated_tokens=self._generated_tokens, steps=self._steps,
                queued=queued, active=len(live) - queued, completed=self._finish_counts["completed"],
                cancelled=self._finish_counts["cancelled"], failed=self._finish_counts["failed"],
                prompt_tokens=self._prompt_tokens, reused_tokens=self._reused_tokens, pages=self._pages,
                buckets=buckets, requests=tuple(live + finished), drafts=self._drafts)

    def _trim(self, now: float) -> None:
        while self._recent and self._recent[0][0] <= now - self._window_s:
            self._recent.popleft()
