"""Executors run a scheduler's StepPlans on a device: `EagerExecutor` (the plain-torch
reference, `--device cpu`) and `GraphExecutor` (CUDA graphs over FlashInfer attention)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from flare_core.ops.sampling import PenaltyBook, SampleOutput, StepSampling
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
