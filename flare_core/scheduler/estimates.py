"""Step-cost estimates learned from measured step durations.

A bucket is (step kind, graph capacity), mixed steps counting as prefill steps. Its estimate is
the median of its most recent observations (robust to a stray slow step). A bucket with no data
yet uses a linear prior scaled by how far the prior has been off for the same kind, so one
measured capacity already corrects the others of that kind.
"""

from __future__ import annotations

import enum
import math
import statistics
from collections import deque
from dataclasses import dataclass


class StepKind(str, enum.Enum):
    """The graph a step replays. Values match the contract's graph kinds."""

    DECODE = "decode"     # capacity = batch rows, one token per request
    PREFILL = "prefill"   # capacity = tokens of packed prompt chunks
    MIXED = "mixed"       # capacity = tokens: one per decode row plus prompt chunk tokens
    SPECULATIVE = "speculative"  # capacity = tokens: each decode row's, and the drafts some rows check
    RESTORE = "restore"   # no forward pass: only restore copies and sampling from stored logits


@dataclass(frozen=True)
class CostPrior:
    """Seconds a step is assumed to take before any measurement: fixed + per_token * capacity
    (a decode row counts as one token)."""

    fixed_s: float = 0.008
    per_token_s: float = 3e-5

    def __post_init__(self) -> None:
        if not (self.fixed_s > 0 and math.isfinite(self.fixed_s)):
            raise ValueError(f"CostPrior fixed_s must be a positive number, got {self.fixed_s}")
        if not (self.per_token_s >= 0 and math.isfinite(self.per_token_s)):
            raise ValueError(f"CostPrior per_token_s must be >= 0, got {self.per_token_s}")

    def seconds(self, kind: StepKind, capacity: int) -> float:
        return self.fixed_s + self.per_token_s * capacity


# A mixed step (decode rows beside prompt chunks) replays the prefill graph of its capacity: the
# two kinds share their buckets, so mixed steps are rated by what prefill steps measured (and
# the reverse) rather than by the prior until one of their own has run.
_BUCKET_KIND = {StepKind.MIXED: StepKind.PREFILL}
# Until a speculative round has run, its prior is scaled as decode steps measured theirs: rounds
# are decode steps of a few more tokens, and a prior left at its own scale would price them in
# the prior's absolute seconds against measured decode steps (on a GPU, hundreds of times
# faster), so that no round would ever be tried, and measured.
_PRIOR_SCALE_KIND = {StepKind.SPECULATIVE: StepKind.DECODE}


class StepCostEstimator:
    """Median of the last `window` observations per (kind, capacity) bucket; mixed and prefill
    steps of one capacity share a bucket."""

    def __init__(self, prior: CostPrior | None = None, window: int = 16) -> None:
        if window < 1:
            raise ValueError(f"StepCostEstimator window must be >= 1, got {window}")
        self.prior = prior or CostPrior()
        self.window = window
        self._buckets: dict[tuple[StepKind, int], deque[float]] = {}
        self._prior_ratios: dict[StepKind, deque[float]] = {}

    def observe(self, kind: StepKind, capacity: int, seconds: float) -> None:
        if not (seconds > 0 and math.isfinite(seconds)):
            raise ValueError(f"measured step duration must be a positive number of seconds, got {seconds}")
        kind = _BUCKET_KIND.get(kind, kind)
        self._buckets.setdefault((kind, capacity), deque(maxlen=self.window)).append(seconds)
        ratio = seconds / self.prior.seconds(kind, capacity)
        self._prior_ratios.setdefault(kind, deque(maxlen=self.window)).append(ratio)

    def estimate(self, kind: StepKind, capacity: int) -> float:
        kind = _BUCKET_KIND.get(kind, kind)
        observed = self._buckets.get((kind, capacity))
        if observed:
            return statistics.median(observed)
        ratios = self._prior_ratios.get(kind) or self._prior_ratios.get(_PRIOR_SCALE_KIND.get(kind, kind))
        scale = statistics.median(ratios) if ratios else 1.0
        return self.prior.seconds(kind, capacity) * scale

    def observations(self, kind: StepKind, capacity: int) -> int:
        return len(self._buckets.get((_BUCKET_KIND.get(kind, kind), capacity), ()))
