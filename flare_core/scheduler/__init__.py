"""Request lifecycle, step plans, selection policy and step-cost estimates."""

from flare_core.scheduler.estimates import CostPrior, StepCostEstimator, StepKind
from flare_core.scheduler.policy import Candidate, FairnessLimits, GraphCapacities, chunk_end, rank
from flare_core.scheduler.request import Request, RequestHandle, RequestStatus, Restore
from flare_core.scheduler.scheduler import (
    DecodeEntry,
    PrefillChunk,
    Resources,
    SampledToken,
    Scheduler,
    SchedulerConfig,
    StepPlan,
    StepResult,
)
from flare_core.scheduler.speculation import dropped_rows

__all__ = [
    "CostPrior", "StepCostEstimator", "StepKind",
    "Candidate", "FairnessLimits", "GraphCapacities", "chunk_end", "rank",
    "Request", "RequestHandle", "RequestStatus", "Restore",
    "DecodeEntry", "PrefillChunk", "Resources", "SampledToken", "Scheduler", "SchedulerConfig", "StepPlan",
    "StepResult", "dropped_rows",
]
