"""The model runner: one served model's device state and the ways to run a step over it.

`step(plan, sampling)` picks one way per step, explicitly: a captured graph where one covers the
step (`GraphRunner.can_run`), otherwise the eager runner, which runs every step. Both read and
write the same `DeviceState` (cache storage, snapshot and logits rows, last sampled tokens,
penalty histories) and neither reaches into the other. `HostCopies` starts each step's output on
its way to the host. `eager_runner` builds the CPU runner (the reference); `cuda_runner`
(flare_core.executor.graphs) the CUDA one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from flare_core.contract import CacheScheme
from flare_core.executor.eager import EagerRunner
from flare_core.executor.sampling import PromptScores, SampleOutput, Sampler, StepSampling
from flare_core.executor.state import DeviceState
from flare_core.scheduler import StepPlan

if TYPE_CHECKING:
    from flare_core.executor.graphs import GraphRunner


class HostCopies:
    """Starts copying a step's output to the host without waiting for it. On CUDA the copies run
    on a stream of their own once the step has produced the output (`last`: the event of the
    latest copy, which a replay that rewrites an output buffer waits for); elsewhere they are
    complete once the step's own work is."""

    def __init__(self, device: torch.device):
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.last: torch.cuda.Event | None = None

    def start(self, output: SampleOutput) -> tuple[SampleOutput, torch.cuda.Event | None]:
        if self._stream is None:
            return self._copies(output), None
        ready = torch.cuda.Event()
        ready.record()
        self._stream.wait_event(ready)
        with torch.cuda.stream(self._stream):
            host = self._copies(output)
            copied = torch.cuda.Event()
            copied.record()
        scored = [t for s in output.prompt_scores for t in (s.logprobs, s.top_ids, s.top_logprobs)]
        for t in (output.token_ids, output.logprobs, output.top_ids, output.top_logprobs, *scored):
            if t is not None:  # the allocator must not hand their memory out before the copy has read it
                t.record_stream(self._stream)
        self.last = copied
        return host, copied

    @staticmethod
    def _copies(output: SampleOutput) -> SampleOutput:
        return SampleOutput(*(None if t is None else t.to("cpu", non_blocking=True) for t in
                              (output.token_ids, output.logprobs, output.top_ids, output.top_logprobs)),
                            prompt_scores=tuple(s.to("cpu", non_blocking=True) for s in output.prompt_scores))


class ModelRunner:
    """What the engine runs steps with (the `Executor` protocol, flare_core.executor)."""

    def __init__(self, state: DeviceState, sampler: Sampler, eager: EagerRunner, copies: HostCopies,
                 graphs: GraphRunner | None = None):
        self.state = state
        self.sampler = sampler
        self.eager = eager
        self.copies = copies
        self.graphs = graphs
        self.device = state.device
        self.penalties = state.penalties
        # Steps the engine keeps issued ahead of the one whose results it reads: replays return
        # before the device has run them, so the host can prepare the next step meanwhile; an
        # eager step runs to completion, leaving nothing to overlap.
        self.frames_in_flight = 2 if graphs is not None else 1

    @property
    def model(self) -> torch.nn.Module:
        return self.eager.model

    @property
    def storage(self) -> dict[str, list[torch.Tensor]]:
        return self.state.storage

    def summary(self) -> str:
        """How steps run, and what was compiled and captured: one line for the startup log."""
        return self.graphs.summary() if self.graphs is not None else "eager reference (plain-torch paged attention)"

    def step(self, plan: StepPlan, sampling: StepSampling | None) -> SampleOutput | None:
        """Run `plan` and sample what it samples (None when it samples and scores nothing)."""
        if self.graphs is not None and self.graphs.can_run(plan):
            return self.graphs.step(plan, sampling)
        return self.eager.step(plan, sampling)

    def run(self, plan: StepPlan) -> torch.Tensor:
        """Logits [len(plan.samples), vocab] of `plan` in `plan.samples` order, unsampled (the
        parity tests' view of a step)."""
        return self.run_scored(plan)[0]

    def run_scored(self, plan: StepPlan) -> tuple[torch.Tensor, tuple[PromptScores, ...]]:
        """`run`, and the prompt scores of the chunks that carry prompt targets."""
        if self.graphs is not None and self.graphs.can_run(plan):
            return self.graphs.logits(plan), ()
        return self.eager.run_scored(plan)

    def record_sampled(self, state_rows: list[int], tokens: torch.Tensor, penalised: bool = False) -> None:
        self.state.record_sampled(state_rows, tokens, penalised)

    def to_host(self, output: SampleOutput) -> tuple[SampleOutput, torch.cuda.Event | None]:
        """Host copies of a step's output, enqueued without a host wait; the event (None: complete
        with the step itself) passes once they are done."""
        return self.copies.start(output)

    def resize_cache(self, num_pages: int) -> None:
        """Replace the cache storage by one of `num_pages` pages and capture the graphs again over
        it (they read the storage's addresses). Meant for start-up: the CUDA runner is built over
        a one-page cache, so that the pool can be sized from what compilation, the graphs and the
        largest prompt chunk leave free."""
        if self.graphs is not None:
            self.graphs.release()  # frees the graphs' pool: the plan counted it, the new capture takes it again
        self.state.resize(num_pages)
        if self.graphs is not None:
            self.graphs.prepare()


def eager_runner(model: torch.nn.Module, scheme: CacheScheme, *, num_pages: int, page_tokens: int, num_rows: int,
                 num_snapshot_rows: int, num_logits_rows: int, vocab_size: int, device: torch.device,
                 seed: int = 0, round_saves: bool = False,
                 final_hidden: Callable[[StepPlan, torch.Tensor], None] | None = None) -> ModelRunner:
    """The eager runner with plain-torch attention: the reference, and what `--device cpu` serves.
    `round_saves`: the server speculates over continuation state (DeviceState). `final_hidden`:
    what is handed each step's final hidden states (EagerRunner)."""
    state = DeviceState(scheme, num_pages=num_pages, page_tokens=page_tokens, num_rows=num_rows,
                        num_snapshot_rows=num_snapshot_rows, num_logits_rows=num_logits_rows, vocab_size=vocab_size,
                        device=device, round_saves=round_saves)
    sampler = Sampler(seed=seed, device=device)
    return ModelRunner(state, sampler, EagerRunner(model, state, sampler, final_hidden=final_hidden),
                       HostCopies(device))
