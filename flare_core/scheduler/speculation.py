"""Speculative decoding in the scheduler: which requests get draft tokens for the step being
planned, and what a step that checked drafts settles (flare_core.scheduler.proposals proposes
them; the executor samples every drafted position as plain decoding would).

A request proposes only with no step of it in flight (its last token known to the host). With two
steps in flight it sits its next step out to do so (`Request.waits_to_speculate`): a round then
takes two step slots and gives 1 + kept tokens where plain decoding gives 2, so unless its last
round kept MIN_KEPT_TO_WAIT drafts or more (or when it had nothing to check), it decodes plainly
for PLAIN_AFTER_MISS samples before it waits to propose again. (With one step in flight nothing
waits: every step proposes.) Drafts ride only in steps that hold them (`StepBuilder.reserve`: no
prompt chunks, rows and drafts within the largest speculative capacity): a request
whose proposal found no room decodes plainly for PLAIN_AFTER_MISS samples too, and while the
running requests alone fill that capacity, none proposes.

Each request's width is its own (`Speculation.width`): of 0 (no round) to `draft_tokens` drafts,
the one that gives the most tokens per unit of cost, its tokens expected from the drafts it kept by
depth so far (`Acceptance`), the cost of a round against a plain decode step of the running rows
from the scheduler's measured step costs and the proposer's (`round_costs`, once per step). A
request whose drafts are seldom kept, or a batch whose rounds cost what their drafts would bring,
decodes plainly; one that copies its input widens its rounds.

Over a cache with continuation state (`SchedulerConfig.continuation_state`: recurrent and
convolution state, sliding windows, compressors' pending groups) a round runs every draft through
the request's state row, and no family's state can drop the refused ones again. So a round that
refuses some is followed by a rewind: the request's next step is a chunk from the round's first
position over what it kept and the sample after them (`PrefillChunk.rewind`), which starts from
the row as the round found it (the executor keeps it, `DeviceState.round_saves`), and samples the
next token as a plain decode would. Cache records past what was kept are simply overwritten.
The width rule prices that: a round that may not keep all its drafts costs, besides itself, the
chance of a rewind times what the rewind's step costs beyond the plain decode step it replaces
(`rewind_costs`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from flare_core.scheduler.estimates import StepCostEstimator, StepKind
from flare_core.scheduler.policy import GraphCapacities
from flare_core.scheduler.proposals import Proposer
from flare_core.scheduler.request import Request, RequestStatus

if TYPE_CHECKING:
    from flare_core.scheduler.scheduler import DecodeEntry, SchedulerConfig, StepPlan

PLAIN_AFTER_MISS = 16
MIN_KEPT_TO_WAIT = 2


def kept_drafts(plan: StepPlan, tokens: Sequence[int]) -> list[tuple[DecodeEntry, int, int]]:
    """(decode, its first sample row, drafts kept) for each decode of `plan` with drafts, given
    the step's sampled `tokens` (plan.samples order): a draft is kept while the sample before it
    equals it."""
    outcomes = []
    row = sum(1 for r in plan.restores if r.logits_row is not None)  # the decodes' rows come next
    for decode in plan.decodes:
        if decode.drafts:
            kept = 0
            while kept < len(decode.drafts) and tokens[row + kept] == decode.drafts[kept]:
                kept += 1
            outcomes.append((decode, row, kept))
        row += 1 + len(decode.drafts)
    return outcomes


def _dropped(decode: DecodeEntry, row: int, kept: int) -> range:
    """The sample rows of `decode` (from `row`) past the one after its kept drafts: dropped."""
    return range(row + kept + 1, row + len(decode.drafts) + 1)


def dropped_rows(plan: StepPlan, tokens: Sequence[int]) -> set[int]:
    """The sample rows of `plan` that its decodes' drafts leave unused (see `kept_drafts`)."""
    return {row for decode, first, kept in kept_drafts(plan, tokens) for row in _dropped(decode, first, kept)}


@dataclass(eq=False)
class Speculation:
    """Up to `draft_tokens` drafts per decode row from `proposer` (None: the scheduler does not
    speculate), in steps within the speculative capacities of `capacities`, priced by
    `estimator`; and the totals so far: drafts checked, drafts kept, decode rows that checked
    some (metrics)."""

    proposer: Proposer | None
    draft_tokens: int
    capacities: GraphCapacities
    estimator: StepCostEstimator
    rewinds: bool = False  # a round that refuses drafts is computed again up to what it kept
    drafts: int = 0
    kept: int = 0
    rounds: int = 0
    widths: list[int] = field(default_factory=list)  # rounds by their drafts (index)

    @classmethod
    def of(cls, config: SchedulerConfig, estimator: StepCostEstimator) -> Speculation:
        return cls(config.proposer, config.draft_tokens, config.capacities, estimator,
                   rewinds=config.continuation_state)

    def round_costs(self, rows: int, most: int) -> list[float]:
        """What a round of `rows` decode rows each checking w drafts costs against a plain decode
        step of them, for w = 1 .. `most` (entry w - 1): the step (the estimator's figures) and
        the proposals (the proposer's own measure, one per row); the list ends at the first width
        past the speculative capacities."""
        step = self._plain_step(rows)
        if step is None or self.proposer is None:
            return []
        costs = []
        for width in range(1, most + 1):
            tokens = self.capacities.covering(StepKind.SPECULATIVE, rows * (1 + width))
            if tokens is None:
                break
            costs.append((self.estimator.estimate(StepKind.SPECULATIVE, tokens)
                          + rows * self.proposer.seconds(width)) / step)
        return costs

    def rewind_costs(self, rows: int, most: int) -> list[float]:
        """What a rewind after a round of w = 1 .. `most` drafts costs beyond a plain decode step of
        `rows` rows (entry w - 1; none without `rewinds`): its chunk of up to w + 1 tokens beside
        the other rows' decodes, a step of rows + w tokens, against the decode step it replaces."""
        step = self._plain_step(rows)
        if not self.rewinds or step is None:
            return []
        costs = []
        for width in range(1, most + 1):
            tokens = self.capacities.covering(StepKind.PREFILL, rows + width)
            rewind = self.estimator.estimate(StepKind.PREFILL, tokens) if tokens is not None else math.inf
            costs.append(max(rewind - step, 0.0) / step)
        return costs

    def _plain_step(self, rows: int) -> float | None:
        """The estimated seconds of a plain decode step of `rows` rows (None past the capacities)."""
        plain = self.capacities.covering(StepKind.DECODE, rows)
        return None if plain is None else self.estimator.estimate(StepKind.DECODE, plain)

    @staticmethod
    def width(request: Request, costs: Sequence[float], rewinds: Sequence[float] = ()) -> int:
        """The drafts `request` should check in a round whose cost at w drafts is costs[w - 1]
        (`round_costs`; 0: none), plus, where given, rewinds[w - 1] (`rewind_costs`) times the
        chance it does not keep them all: the width of the most expected tokens per unit of cost,
        a plain step giving one token at cost 1."""
        best, rate = 0, 1.0
        for width, cost in enumerate(costs, start=1):
            if width <= len(rewinds):
                cost += (1.0 - request.acceptance.chance_kept(width)) * rewinds[width - 1]
            tokens = request.acceptance.expected_tokens(width) / cost
            if tokens > rate:
                best, rate = width, tokens
        return best

    def counts(self) -> dict[str, Any]:
        """The totals as `Resources` fields."""
        return {"drafts": self.drafts, "accepted_drafts": self.kept, "draft_rounds": self.rounds,
                "draft_widths": tuple(self.widths)}

    def propose(self, live: Sequence[Request]) -> None:
        """Set each live request's drafts for the step being planned (none for most): those that
        could decode with no step in flight get up to their remaining budget less the token the
        step samples anyway."""
        if self.proposer is None:
            return
        rows = sum(r.status is RequestStatus.RUNNING for r in live)
        crowded = rows >= self.capacities.largest(StepKind.SPECULATIVE)
        costs = [] if crowded else self.round_costs(rows, self.draft_tokens)  # the same for every request
        rewinds = [] if crowded else self.rewind_costs(rows, self.draft_tokens)
        for request in live:
            request.drafts = ()
            most = min(self.draft_tokens, request.max_tokens - request.num_planned_samples - 1)
            if crowded and request.speculate:
                request.plain_until = request.num_planned_samples + PLAIN_AFTER_MISS
            elif request.speculate and request.in_flight == 0 and most > 0 and request.can_decode():
                width = self.width(request, costs[:most], rewinds[:most])
                if width:
                    request.drafts = self.proposer.propose(request.known_tokens(), width, request.request_id,
                                                           request.draw, request.num_planned_samples)
                else:
                    request.acceptance.fade()
                if not request.drafts:
                    request.plain_until = request.num_planned_samples + PLAIN_AFTER_MISS

    def placed(self, decoders: Sequence[Request], granted: dict[str, tuple[int, ...]]) -> None:
        """Of the step's `decoders`, those whose proposal got no drafts `granted` (no room in the
        step) decode plainly for a while rather than sit out steps waiting for a round."""
        for request in decoders:
            if request.drafts and request.request_id not in granted:
                request.plain_until = request.num_planned_samples + PLAIN_AFTER_MISS

    def settle(self, plan: StepPlan, tokens: Sequence[int], request_of: Callable[[str], Request]) -> set[int]:
        """The drafts of `plan`'s decodes checked (`kept_drafts`): each request then stands after its
        kept drafts and the sample that follows them, what it planned beyond given back (positions
        to compute, samples to draw; its records there are overwritten as it decodes on); with
        `rewinds`, one that refused some computes again from the round's position (the module
        docstring). Returns the sample rows to drop."""
        dropped: set[int] = set()
        for decode, row, kept in kept_drafts(plan, tokens):
            request = request_of(decode.handle.request_id)
            dropped.update(_dropped(decode, row, kept))
            request.num_written = max(request.num_written, decode.position + 1 + kept)
            request.num_computed -= len(decode.drafts) - kept
            request.num_planned_samples -= len(decode.drafts) - kept
            if self.rewinds and kept < len(decode.drafts):
                # Its input, the kept drafts and the sample after them: a chunk that samples next.
                request.num_computed = decode.position
                request.target = decode.position + kept + 2
                request.rewinds = True
            request.verifying = False
            request.acceptance.record(len(decode.drafts), kept)
            if kept < MIN_KEPT_TO_WAIT:
                request.plain_until = request.num_planned_samples + PLAIN_AFTER_MISS
            self.drafts += len(decode.drafts)
            self.kept += kept
            self.rounds += 1
            self.widths += [0] * (len(decode.drafts) + 1 - len(self.widths))
            self.widths[len(decode.drafts)] += 1
        return dropped
