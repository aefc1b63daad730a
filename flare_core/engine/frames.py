"""Issued steps whose results the host has not read yet (frames), and the sampling of a step
assembled from its requests.

A frame brackets its step with CUDA events on the device (its duration is the device's), and
its output's copy to the host has an event of its own where it runs on a copy stream. Reading a
frame's tokens is the only place the engine core blocks on the device."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from flare_core.engine.live import LiveRequest
from flare_core.engine.stats import HostTimes
from flare_core.executor import Executor
from flare_core.executor.sampling import LogitBias, SampleOutput, StepSampling
from flare_core.requests import SamplingParams
from flare_core.scheduler import Scheduler, StepPlan

# How a row samples whose request finished meanwhile: greedily, for nothing.
_FINISHED_ROW = SamplingParams(temperature=0.0)


@dataclass(eq=False)
class Frame:
    """One issued step: its plan and, once read, its sampled tokens and duration."""

    plan: StepPlan
    issued: float  # perf_counter() at launch
    output: SampleOutput | None = None  # host tensors; filled once `done` and `copied` have passed
    started: torch.cuda.Event | None = None  # CUDA only: bracket the step on the device's clock
    done: torch.cuda.Event | None = None
    copied: torch.cuda.Event | None = None  # the output's copy to the host, where it has its own stream
    tokens: list[int] | None = None  # the sampled tokens, once the host has waited for them
    duration: float = 0.0  # the step's time (on the device's clock on CUDA), once waited for
    waited_s: float = 0.0  # the host's time blocked on it
    host: HostTimes = HostTimes()  # the host's time planning and launching it
    matchers_advanced: bool = False  # its tokens have advanced their requests' grammar matchers

    @classmethod
    def launch(cls, executor: Executor, plan: StepPlan, sampling: StepSampling | None, cuda: bool) -> Frame:
        """Issue `plan` and its sampling; start copying what it samples to the host."""
        frame = cls(plan, time.perf_counter())
        if cuda:
            frame.started = torch.cuda.Event(enable_timing=True)
            frame.started.record()
        output = executor.step(plan, sampling)
        if output is not None:
            frame.output, frame.copied = executor.to_host(output)
        if cuda:
            frame.done = torch.cuda.Event(enable_timing=True)
            frame.done.record()
        return frame

    def wait(self) -> list[int]:
        """Wait for the step's results on the host; its sampled tokens (plan.samples order)."""
        if self.tokens is None:
            start = time.perf_counter()
            if self.copied is not None:
                self.copied.synchronize()
            if self.done is not None:
                self.done.synchronize()
                self.duration = self.started.elapsed_time(self.done) / 1000.0  # device time of this step
            else:
                self.duration = time.perf_counter() - self.issued
            self.tokens = self.output.token_ids.tolist() if self.output is not None else []
            self.waited_s = time.perf_counter() - start
        return self.tokens


def step_sampling(plan: StepPlan, lives: Sequence[LiveRequest | None], scheduler: Scheduler, executor: Executor,
                  masks: Callable[[], torch.Tensor] | None) -> StepSampling | None:
    """How `plan` samples each of its rows (`plan.samples` order; `lives[i]` the request of row
    i, None for one finished meanwhile, which samples greedily for nothing). Binds the executor's
    penalty history row of each penalised request's state row to it (again, after a preemption
    moved it) before the step that samples its next token. `masks`: the grammar masks of the
    step's rows, for steps where some row has a grammar."""
    samples = plan.samples
    if not samples:
        return None
    # The scheduler holds each request's confirmed output tokens and counts its samples planned
    # so far, this plan's included: seeded sampling continues its stream from there.
    states = [scheduler.request(h.request_id) for h in samples]
    for handle, live, state in zip(samples, lives, states):
        if live is not None and live.request.sampling.penalised and live.penalty_handle != handle:
            live.penalties = executor.penalties.start(handle.state_row, live.request.prompt_ids, state.outputs)
            live.penalty_handle = handle
    # A decode with drafts samples once per position: row i continues the seeded stream i steps on,
    # and its penalties count the drafts before it as output.
    drafts_of = plan.drafts_of
    rows_of = Counter(samples)
    seen: Counter = Counter()
    steps, penalties = [], []
    for handle, live, state in zip(samples, lives, states):
        position = seen[handle]
        seen[handle] += 1
        steps.append(state.num_planned_samples - rows_of[handle] + position)
        history = live.penalties if live is not None else None
        if history is not None and position > 0:
            history = history.plus(drafts_of[handle][:position])
        penalties.append(history)
    for handle in drafts_of:
        live = lives[samples.index(handle)]
        if live is not None and live.penalties is not None:
            live.penalty_handle = None  # the step counts every row's token: start the history over next time
    asking = [live for live in lives if live is not None and live.request.logprobs]
    return StepSampling(
        params=[live.request.sampling if live else _FINISHED_ROW for live in lives],
        steps=steps,
        penalties=penalties,
        logprobs=bool(asking),
        top_logprobs=max((live.request.top_logprobs for live in asking), default=0),
        masks=masks,
        logit_bias=logit_bias(lives))


def logit_bias(lives: Sequence[LiveRequest | None]) -> LogitBias | None:
    """The step's logit biases by sampling row, or None when no row has any."""
    entries = [(row, token, value) for row, live in enumerate(lives) if live is not None
               for token, value in live.request.logit_bias]
    return LogitBias(*zip(*entries)) if entries else None
