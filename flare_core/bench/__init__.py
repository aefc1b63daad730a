"""`flare bench`: an HTTP load generator for OpenAI-compatible servers (Flare's own or any other)."""

from flare_core.bench.client import BenchError, RequestResult, Target
from flare_core.bench.datasets import BenchRequest, conversation_requests, random_requests, shared_prefix_requests
from flare_core.bench.metrics import BenchMetrics, Distribution, compute_metrics, percentile
from flare_core.bench.runner import BenchRun, arrival_offsets, run_benchmark

__all__ = [
    "BenchError", "BenchMetrics", "BenchRequest", "BenchRun", "Distribution", "RequestResult", "Target",
    "arrival_offsets", "compute_metrics", "conversation_requests", "percentile", "random_requests",
    "run_benchmark", "shared_prefix_requests",
]
