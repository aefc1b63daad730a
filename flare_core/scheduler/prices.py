"""Service prices: how far each request is behind the pace it would have alone, the one measure
the scheduler's fairness uses (which step runs, whose prompt chunk goes first, who is admitted to
a state row and, for a request left waiting too long, who gives one up).

A request's price is its group's recent slowdown, projected to the end of its next unit of work:

    price = (elapsed + unit) / (served alone + unit)

where `elapsed` is the time its group has been present, `served alone` what the service its group
has had would have cost run alone — both forgotten at the rate `memory_s` (each second counts
e**(-age / memory_s)), so that a price tells how a group fares now, not since it came — and
`unit` the request's own next unit run alone (its next prompt chunk, or one decode row). Times
are the step cost estimator's seconds on the scheduler's clock (the estimated durations of the
steps it issued), so prices are deterministic for a given sequence of steps. A price grows while
its request waits, the faster the cheaper its own work: a short chat behind one long prompt's
chunk gains tens of units a step, the long prompt a fraction of one. It falls as its request is
served at its own pace. A group is what the engine says shares one price: the requests of one
client address (so one client's eight long prompts or sixty choices weigh as one client against
another's chat, while the many requests of one benchmark client compare by their own units
alone), or a request and its `n` choices.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from flare_core.scheduler.estimates import StepCostEstimator, StepKind
from flare_core.scheduler.policy import GraphCapacities
from flare_core.scheduler.request import Request


@dataclass
class _Group:
    elapsed_s: float = 0.0  # time present, forgotten at the rate memory_s
    alone_s: float = 0.0    # alone cost of the service had, forgotten at the same rate
    members: int = 0


class ServicePrices:
    """Each request group's recent service, on the scheduler's clock (see the module docstring)."""

    def __init__(self, estimator: StepCostEstimator, capacities: GraphCapacities, prefill_chunk_size: int,
                 memory_s: float = 10.0):
        self.estimator = estimator
        self.memory_s = memory_s
        self.capacities = capacities
        self.prefill_chunk_size = prefill_chunk_size
        self._groups: dict[str, _Group] = {}
        self._estimates: dict[tuple[StepKind, int], float] = {}  # this planning round's, see refresh()

    def refresh(self) -> None:
        """Forget the step estimates read so far (call before planning a step: completions may
        have changed them). Within one round each (kind, capacity) is read from the estimator once."""
        self._estimates.clear()

    def _estimate(self, kind: StepKind, capacity: int) -> float:
        key = (kind, capacity)
        if key not in self._estimates:
            self._estimates[key] = self.estimator.estimate(kind, capacity)
        return self._estimates[key]

    def join(self, request: Request) -> None:
        group = self._groups.setdefault(request.group, _Group())
        group.members += 1

    def leave(self, request: Request) -> None:
        group = self._groups[request.group]
        group.members -= 1
        if not group.members:
            del self._groups[request.group]

    def decode_s(self) -> float:
        """One decode row run alone."""
        return self._estimate(StepKind.DECODE, self.capacities.covering(StepKind.DECODE, 1) or 1)

    def restore_s(self) -> float:
        """A step of restores alone (copies from the prefix cache, a first token from stored logits)."""
        return self._estimate(StepKind.RESTORE, 0)

    def chunk_s(self, tokens: int) -> float:
        """A prompt chunk of `tokens` run alone."""
        capacity = self.capacities.covering(StepKind.PREFILL, tokens) or self.capacities.largest(StepKind.PREFILL)
        return self._estimate(StepKind.PREFILL, capacity)

    def served(self, restoring: Iterable[Request], decoders: Iterable[Request],
               chunks: Iterable[tuple[Request, int]]) -> dict[Request, float]:
        """What a step serves each of its requests, as alone cost: a restore, a decode row, or a
        prompt chunk of so many tokens."""
        served = {r: self.restore_s() for r in restoring}
        served.update((r, self.decode_s()) for r in decoders)
        served.update((r, self.chunk_s(tokens)) for r, tokens in chunks)
        return served

    def unit_s(self, request: Request) -> float:
        """The request's next unit of work run alone: its next prompt chunk (a waiting request's
        first), or one decode row."""
        if request.handle is None or not request.prefill_done:
            remaining = (request.target - request.num_computed if request.handle is not None
                         else request.num_known_tokens)
            return self.chunk_s(max(1, min(remaining, self.prefill_chunk_size)))
        return self.decode_s()

    def price(self, request: Request, step_s: float = 0.0, served_s: float = 0.0, unit_s: float | None = None) -> float:
        """The request's price after a step of `step_s` that serves it work worth `served_s` alone
        (0: the step leaves it out); with the defaults, its price now."""
        group = self._groups[request.group]
        unit = self.unit_s(request) if unit_s is None else unit_s
        return (group.elapsed_s + step_s + unit) / (group.alone_s + served_s + unit)

    def advance(self, step_s: float, served: Mapping[Request, float]) -> None:
        """A step of `step_s` was issued, serving each request in `served` work worth that much alone."""
        kept = math.exp(-step_s / self.memory_s)
        for group in self._groups.values():
            group.elapsed_s = group.elapsed_s * kept + step_s
            group.alone_s *= kept
        for request, alone_s in served.items():
            self._groups[request.group].alone_s += alone_s
