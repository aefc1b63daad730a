"""What the engine core reports of its work: one `Activity` record per call of `EngineCore.step`
(and of `EngineCore.take` between steps), read by `/metrics` (flare_core.observability.metrics) and the
dashboard (flare_core.observability.telemetry) alike. Only counts, sizes and timings: no token ids
or text."""

from __future__ import annotations

from dataclasses import dataclass, field

from flare_core.kv import PrefixCacheStats
from flare_core.requests import GenerationEvent, Usage
from flare_core.scheduler import Resources


@dataclass(frozen=True)
class HostTimes:
    """Where the host spent a step, in seconds: planning it (the scheduler), launching it
    (inputs, attention plans, replays or eager kernels), reading it back (output processing,
    events), and blocked on the device (waiting for its tokens, also inside the other phases)."""

    schedule_s: float = 0.0
    launch_s: float = 0.0
    read_s: float = 0.0
    wait_s: float = 0.0


@dataclass(frozen=True)
class StepStats:
    """One step read back: its kind (StepKind's value) and graph capacity, its duration (on the
    device's clock on CUDA), the tokens it computed (decode rows and prompt-chunk tokens,
    padding excluded) and of those the prompt-chunk tokens, the requests whose sampled token it
    confirmed (those still live), and the host's time on it."""

    kind: str
    capacity: int
    duration_s: float
    computed_tokens: int
    prefill_tokens: int
    sampled: tuple[str, ...]
    host: HostTimes


@dataclass(frozen=True)
class Finished:
    """A request that ended: why, and what it used."""

    request_id: str
    reason: str  # "stop", "length", "cancelled" or "error"
    usage: Usage


@dataclass
class Activity:
    """What the engine core did since the last report, in order of kind: requests queued
    (id, prompt tokens), requests started (id, prompt tokens reused from the prefix cache),
    steps read back, requests whose first output token was confirmed (their prompt is prefilled:
    later choices of the same prompt may follow, flare_core.engine.service), the latencies of
    first tokens and the gaps between later ones, requests finished; the events to deliver, by
    request; and, as of the end, the resources held and the prefix cache's running totals."""

    queued: list[tuple[str, int]] = field(default_factory=list)
    started: list[tuple[str, int]] = field(default_factory=list)
    steps: list[StepStats] = field(default_factory=list)
    prefilled: list[str] = field(default_factory=list)
    first_token_s: list[float] = field(default_factory=list)
    token_gaps_s: list[float] = field(default_factory=list)
    finished: list[Finished] = field(default_factory=list)
    events: list[tuple[str, GenerationEvent]] = field(default_factory=list)
    issued: int = 0  # steps launched
    resources: Resources | None = None
    prefix: PrefixCacheStats | None = None

    @property
    def progressed(self) -> bool:
        """Whether a step was launched or read back."""
        return bool(self.issued or self.steps)
