"""Executors run a scheduler's StepPlans on a device. `ModelRunner` (flare_core.executor.runner)
is the one that runs a model: its `DeviceState`, an `EagerRunner` (every step; with plain-torch
attention the reference and all of `--device cpu`) and on CUDA a `GraphRunner` (captured graphs
over FlashInfer attention, flare_core.executor.graphs). Rank 0 of a tensor-parallel server wraps
one in a `LeadingExecutor` (flare_core.engine.tensor_parallel)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from flare_core.executor.sampling import PenaltyBook, SampleOutput, StepSampling
    from flare_core.scheduler import StepPlan


class Executor(Protocol):
    """What the engine needs of an executor."""

    device: torch.device
    frames_in_flight: int  # steps worth keeping issued ahead of the one whose results are read
    penalties: PenaltyBook  # per state row token histories for penalised sampling

    def step(self, plan: StepPlan, sampling: StepSampling | None) -> SampleOutput | None:
        """Run `plan` and sample what it samples (None when it samples nothing)."""

    def to_host(self, output: SampleOutput) -> tuple[SampleOutput, torch.cuda.Event | None]:
        """Start copying `output` to the host; the event (if any) passes once the copy is done."""

    def summary(self) -> str:
        """How steps run, and what was compiled and captured: one line for the startup log."""
