"""Step selection: graph capacities, prompt chunk boundaries, fairness limits, and the choice
between candidate steps by starving prices, then useful tokens per estimated second."""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from flare_core.scheduler.estimates import StepCostEstimator, StepKind


def _capacities(values: Iterable[int], field: str) -> tuple[int, ...]:
    result = tuple(values)
    if any(not isinstance(v, int) or v < 1 for v in result):
        raise ValueError(f"GraphCapacities {field} must be positive integers, got {result}")
    if list(result) != sorted(set(result)):
        raise ValueError(f"GraphCapacities {field} must be strictly increasing, got {result}")
    return result


@dataclass(frozen=True)
class GraphCapacities:
    """The captured graph catalog as data: decode batch capacities (rows), prefill token
    capacities, optional mixed token capacities (decode rows + prompt tokens in one graph), and
    speculative token capacities (decode steps whose rows check draft tokens: one token per row
    and one per draft; none: no step checks drafts)."""

    decode: tuple[int, ...]
    prefill: tuple[int, ...]
    mixed: tuple[int, ...] = ()
    speculative: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "decode", _capacities(self.decode, "decode"))
        object.__setattr__(self, "prefill", _capacities(self.prefill, "prefill"))
        object.__setattr__(self, "mixed", _capacities(self.mixed, "mixed"))
        object.__setattr__(self, "speculative", _capacities(self.speculative, "speculative"))
        if not self.decode or not self.prefill:
            raise ValueError("GraphCapacities needs at least one decode and one prefill capacity")

    @classmethod
    def from_specs(cls, specs: Iterable[object]) -> GraphCapacities:
        """From contract graph specs (objects with `kind` and `capacity`). Without mixed specs,
        the mixed capacities are the prefill ones: both executors run a step of decode rows and prompt chunks as a
        prefill step whose decode rows are one-token requests (the CUDA executor in the prefill
        graph of its token count), so decoding goes on while prompts are prefilled."""
        by_kind: dict[str, list[int]] = {"decode": [], "prefill": [], "mixed": [], "speculative": []}
        for spec in specs:
            kind, capacity = getattr(spec, "kind"), getattr(spec, "capacity")
            if kind in by_kind:
                by_kind[kind].append(capacity)
        by_kind["mixed"] = by_kind["mixed"] or by_kind["prefill"]
        return cls(*(tuple(sorted(set(by_kind[k]))) for k in ("decode", "prefill", "mixed", "speculative")))

    def of(self, kind: StepKind) -> tuple[int, ...]:
        return {StepKind.DECODE: self.decode, StepKind.PREFILL: self.prefill,
                StepKind.MIXED: self.mixed, StepKind.SPECULATIVE: self.speculative}.get(kind, ())

    def covering(self, kind: StepKind, size: int) -> int | None:
        """Smallest capacity of `kind` that holds `size`, or None if none does."""
        capacities = self.of(kind)
        index = bisect.bisect_left(capacities, size)
        return capacities[index] if index < len(capacities) else None

    def largest(self, kind: StepKind) -> int:
        capacities = self.of(kind)
        return capacities[-1] if capacities else 0


@dataclass(frozen=True)
class FairnessLimits:
    """Fairness before throughput, at two levels. Between the requests of one group: a live
    request is overdue once `max_wait_steps` steps, or `max_wait_s` estimated seconds of steps,
    have passed without it advancing; candidates serving more overdue requests win. Between
    groups, by service prices (flare_core.scheduler.prices), which come first: a request's urgency
    is its price should the next full prompt chunk step leave it out; a group (a client) starves
    when its most urgent ready request is at least `starving_ratio` times as urgent as the least
    urgent group's; while one starves, the step that leaves the highest price among the ready
    requests lowest wins. A waiting request whose urgency is `starving_ratio` times the lower
    median of the running ones' is admitted first, and when every state row is taken, the
    running request of the lowest urgency gives it its row (once per request: the one that
    gives it up is admitted again first)."""

    max_wait_steps: int = 4
    max_wait_s: float = 0.2
    starving_ratio: float = 1.25    # math.inf: no group ever starves
    memory_s: float = 10.0          # prices forget service older than about this (flare_core.scheduler.prices)

    def __post_init__(self) -> None:
        if self.max_wait_steps < 1:
            raise ValueError(f"FairnessLimits max_wait_steps must be >= 1, got {self.max_wait_steps}")
        if not (self.max_wait_s > 0 and math.isfinite(self.max_wait_s)):
            raise ValueError(f"FairnessLimits max_wait_s must be a positive number, got {self.max_wait_s}")
        if not self.starving_ratio > 1:
            raise ValueError(f"FairnessLimits starving_ratio must be a number > 1, got {self.starving_ratio}")
        if not (self.memory_s > 0 and math.isfinite(self.memory_s)):
            raise ValueError(f"FairnessLimits memory_s must be a positive number of seconds, got {self.memory_s}")

    def overdue(self, waited_steps: int, waited_s: float) -> bool:
        return waited_steps >= self.max_wait_steps or waited_s >= self.max_wait_s


@dataclass(frozen=True)
class Candidate:
    """One possible next step, as the policy sees it."""

    kind: StepKind
    capacity: int
    useful_tokens: int      # tokens advanced: decode rows + real (unpadded) prompt tokens
    overdue_served: int = 0  # overdue requests this step would advance
    # While a client starves: the highest service price among the ready requests after this step
    # (0.0 otherwise).
    worst_price: float = 0.0
    # Decode rows ready now that the step leaves out (a prompt-only step beside decoders), and
    # the decode capacity that covers them: they will take a step of their own.
    deferred_decodes: int = 0
    deferred_capacity: int = 0


_KIND_PREFERENCE = {StepKind.MIXED: 0, StepKind.DECODE: 1, StepKind.PREFILL: 2, StepKind.RESTORE: 3}
# Candidates whose highest price is within this fraction of the lowest one's are equally fair:
# throughput chooses among them (a request no candidate serves would otherwise make the
# cheapest step win every time, its price growing least).
PRICE_TOLERANCE = 0.05


def rank(candidates: Sequence[Candidate], estimator: StepCostEstimator) -> list[int]:
    """Candidate indices, best first: those leaving the lowest highest price to the ready
    requests (while a client starves; within PRICE_TOLERANCE), then those serving the most
    overdue requests, then most useful tokens per estimated second; ties go to mixed, then
    decode (deterministic).

    A step that leaves ready decode rows out is rated with the decode step those rows then take
    (its tokens and seconds added to its own): against a mixed step that carries them for the
    small cost of a few more tokens, a prompt-only step then wins only when the mixed step
    would pad to a much larger graph. Against a decode-only step nothing changes: the rate of
    the two steps together lies between the rates of each."""

    fair = min((c.worst_price for c in candidates), default=0.0) * (1 + PRICE_TOLERANCE)

    def key(index: int) -> tuple[float, int, float, int]:
        c = candidates[index]
        tokens, seconds = c.useful_tokens, estimator.estimate(c.kind, c.capacity)
        if c.deferred_decodes:
            tokens += c.deferred_decodes
            seconds += estimator.estimate(StepKind.DECODE, c.deferred_capacity)
        return (0.0 if c.worst_price <= fair else c.worst_price, -c.overdue_served, -tokens / seconds,
                _KIND_PREFERENCE[c.kind])

    return sorted(range(len(candidates)), key=key)


def chunk_end(start: int, target: int, budget: int, page_tokens: int,
              boundaries: Sequence[int] = ()) -> int | None:
    """End of the next prompt chunk from `start` toward `target` using at most `budget` tokens.

    A chunk ends at the target, at the first boundary after `start` (an endpoint where a state
    snapshot must be taken), or else at the last page boundary within the budget, so every
    chunk but the final one fills whole pages. None if no valid end fits the budget."""
    if not 0 <= start < target:
        raise ValueError(f"chunk start {start} must be in [0, target={target})")
    limit = start + budget
    natural = target
    index = bisect.bisect_right(boundaries, start)
    if index < len(boundaries) and boundaries[index] < natural:
        natural = boundaries[index]
    if natural <= limit:
        return natural
    aligned = limit // page_tokens * page_tokens
    return aligned if aligned > start else None
