"""Request lifecycle and per-request scheduling state.

Positions: the prompt occupies [0, prompt_len); generated token k sits at prompt_len + k. A step
"computes" a position when it writes that position's cache records. The final prompt position's
logits give generated token 0; a decode step feeds token k at position prompt_len + k and
samples token k + 1.

Lifecycle:
    WAITING --admit--> RUNNING --finish/cancel--> STOPPED --last in-flight step done--> (gone)
    RUNNING --preempt--> PREEMPTED --last in-flight step done--> WAITING (recomputes)
State advanced when a step is planned (`num_computed`, `num_planned_samples`) runs ahead of
state confirmed when it completes (`num_written`, `outputs`), because several plans may be in
flight (the GPU path keeps two).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from flare_core.kv.manager import KvRecord
from flare_core.requests import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"        # queued for a state row (new, or preempted and released)
    RUNNING = "running"        # holds a state row; scheduled
    PREEMPTED = "preempted"    # not scheduled; resources return at its last in-flight step
    STOPPED = "stopped"        # finished or cancelled; resources return at its last in-flight step


@dataclass(frozen=True)
class RequestHandle:
    """Routes a request's step inputs and outputs. The generation increments every time a state row
    is reused, so outputs tagged with a stale handle never reach the state row's next request."""

    request_id: str
    state_row: int
    generation: int


@dataclass(frozen=True)
class Restore:
    """Copies the executor runs before the step's forward pass, from a prefix-cache resume point
    into a newly admitted request's resources."""

    handle: RequestHandle
    tail_copy: tuple[int, int] | None   # (cache tail page, request's private page)
    snapshot_row: int | None           # snapshot row -> the request's state row (handle.state_row)
    logits_row: int | None             # stored next-token logits: sample the first token from them


@dataclass(eq=False)
class Acceptance:
    """A request's drafts by depth (speculative decoding): `checked[d]` counts its rounds that
    checked draft d + 1 with every draft before it kept, `kept[d]` those that kept it too. A round
    says nothing of depths past its own width or its first refused draft (censored, not refused)."""

    checked: list[int] = field(default_factory=list)
    kept: list[int] = field(default_factory=list)

    def record(self, width: int, kept: int) -> None:
        """A round of `width` drafts kept its first `kept`."""
        while len(self.checked) < width:
            self.checked.append(0)
            self.kept.append(0)
        for depth in range(min(kept + 1, width)):
            self.checked[depth] += 1
        for depth in range(kept):
            self.kept[depth] += 1

    def fade(self) -> None:
        """Halve what was seen (a request that stopped proposing on it tries again once the prior
        outweighs its old refusals: its output may have turned to copying since)."""
        self.checked = [count // 2 for count in self.checked]
        self.kept = [min(kept, checked) for kept, checked in zip((k // 2 for k in self.kept), self.checked)]

    def chance_kept(self, width: int) -> float:
        """The chance that a round of `width` drafts keeps them all: the product over depths of
        each depth's chance given the one before, estimated with a uniform prior ((kept + 1) /
        (checked + 2)), so that a depth never checked counts one half."""
        chance = 1.0
        for depth in range(width):
            checked, kept = (self.checked[depth], self.kept[depth]) if depth < len(self.checked) else (0, 0)
            chance *= (kept + 1) / (checked + 2)
        return chance

    def expected_tokens(self, width: int) -> float:
        """Tokens a round of `width` drafts is expected to give (its sample after the kept drafts
        included): 1 + the sum over depths of the chance that every draft up to it is kept."""
        return 1.0 + sum(self.chance_kept(depth) for depth in range(1, width + 1))


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    message_ends: tuple[int, ...]          # message-boundary token endpoints within the prompt, ascending
    order: int                      # submission order: lower is older and has priority
    score_prompt: bool = False      # every prompt position computed, never restored from the cache
    group: str = ""                 # who shares its service price: its client address, or its own request
    client: str = ""                # the client's address, for the cap on live requests per client
    speculate: bool = False         # its decode rows may check draft tokens (speculative decoding)
    draw: SamplingParams | None = None  # how its tokens are sampled, for a proposer that samples drafts
    status: RequestStatus = RequestStatus.WAITING
    outputs: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    kv: KvRecord = field(default_factory=KvRecord)  # what the cache holds for it (the KV-cache manager's)

    # Per admission; reset when released.
    handle: RequestHandle | None = None
    target: int = 0                 # prefill runs to here: prompt plus outputs known at admission
    boundaries: tuple[int, ...] = ()  # chunk ends forced for state snapshots
    num_computed: int = 0
    num_written: int = 0
    num_planned_samples: int = 0
    in_flight: int = 0              # issued plans that include this request
    restore: Restore | None = None  # queued for the next plan
    yielded: bool = False           # gave its state row up once to a starving waiting request
    last_served_seq: int = -1
    waited_s: float = 0.0           # estimated seconds of the steps issued since it last advanced
    drafts: tuple[int, ...] = ()    # proposed for the step being planned
    verifying: bool = False         # a step checking its drafts is in flight: where it stands is not known
    plain_until: int = 0            # it decodes without drafts until it has planned this many samples
    rewinds: bool = False           # its next chunk starts from its state row as its last round found it
    acceptance: Acceptance = field(default_factory=Acceptance)  # its drafts kept by depth, over its life

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    @property
    def num_known_tokens(self) -> int:
        return len(self.prompt) + len(self.outputs)

    @property
    def prefill_done(self) -> bool:
        return self.num_computed >= self.target

    def token_at(self, position: int) -> int | None:
        """The token at `position` if the host knows it yet."""
        if position < len(self.prompt):
            return self.prompt[position]
        index = position - len(self.prompt)
        return self.outputs[index] if index < len(self.outputs) else None

    def known_tokens(self) -> tuple[int, ...]:
        return self.prompt + tuple(self.outputs)

    def tokens_between(self, start: int, end: int) -> tuple[int, ...]:
        if end <= len(self.prompt):
            return self.prompt[start:end]
        return self.known_tokens()[start:end]

    def can_decode(self) -> bool:
        return (self.status is RequestStatus.RUNNING and self.prefill_done and self.restore is None
                and not self.verifying and not self.waits_to_speculate()
                and self.num_planned_samples < self.max_tokens)

    def waits_to_speculate(self) -> bool:
        """A request that speculates proposes from the tokens the host knows: while a step of it
        is in flight it sits out rather than decode without drafts, unless its last proposals
        came to nothing (then it decodes plainly, steps in flight or not, until `plain_until`)."""
        return self.speculate and self.in_flight > 0 and self.num_planned_samples >= self.plain_until

    def can_prefill(self) -> bool:
        return self.status is RequestStatus.RUNNING and not self.prefill_done

    def reset_admission(self) -> None:
        self.handle = None
        self.target = self.num_computed = self.num_written = self.num_planned_samples = 0
        self.boundaries = ()
        self.restore = None
        self.drafts = ()
        self.verifying = False
        self.plain_until = 0
        self.rewinds = False
