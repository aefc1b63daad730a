"""Benchmark metrics from per-request results, with the definitions of `vllm bench serve`.

TTFT: request sent -> first chunk with output. E2EL: request sent -> end of stream.
TPOT (per request): (E2EL - TTFT) / (output tokens - 1), for requests of 2+ output tokens.
ITL: gaps between successive output chunks, pooled over all requests.
Latency distributions are reported in milliseconds; failed requests count in none of them.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from flare_core.bench.client import RequestResult


@dataclass(frozen=True)
class Distribution:
    mean: float
    median: float
    p99: float


@dataclass(frozen=True)
class BenchMetrics:
    completed: int
    failed: int
    duration_s: float
    input_tokens: int
    output_tokens: int
    cached_tokens: int
    request_throughput: float  # completed requests per second
    output_throughput: float  # output tokens per second
    total_token_throughput: float  # input + output tokens per second
    prefix_reuse: float  # share of input tokens served from the prefix cache
    # None where no request gave a sample (e.g. no ITL when every output is one chunk).
    ttft_ms: Distribution | None
    tpot_ms: Distribution | None
    itl_ms: Distribution | None
    e2el_ms: Distribution | None


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), interpolating linearly between the closest ranks."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be within [0, 100], got {q}")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def distribution_ms(seconds: Sequence[float]) -> Distribution | None:
    if not seconds:
        return None
    return Distribution(mean=statistics.fmean(seconds) * 1000, median=percentile(seconds, 50) * 1000,
                        p99=percentile(seconds, 99) * 1000)


def tpot(result: RequestResult) -> float | None:
    """Seconds per output token after the first; None with fewer than two output tokens."""
    if result.output_tokens < 2:
        return None
    return (result.e2el - result.ttft) / (result.output_tokens - 1)


def compute_metrics(results: Sequence[RequestResult], duration_s: float) -> BenchMetrics:
    """Aggregate `results` of a run that took `duration_s` seconds (first send to last completion)."""
    if duration_s <= 0:
        raise ValueError(f"benchmark duration must be positive, got {duration_s}")
    done = [result for result in results if result.ok]
    input_tokens = sum(result.prompt_tokens for result in done)
    output_tokens = sum(result.output_tokens for result in done)
    cached_tokens = sum(result.cached_tokens for result in done)
    tpots = [value for value in map(tpot, done) if value is not None]
    return BenchMetrics(
        completed=len(done), failed=len(results) - len(done), duration_s=duration_s,
        input_tokens=input_tokens, output_tokens=output_tokens, cached_tokens=cached_tokens,
        request_throughput=len(done) / duration_s, output_throughput=output_tokens / duration_s,
        total_token_throughput=(input_tokens + output_tokens) / duration_s,
        prefix_reuse=cached_tokens / input_tokens if input_tokens else 0.0,
        ttft_ms=distribution_ms([result.ttft for result in done]), tpot_ms=distribution_ms(tpots),
        itl_ms=distribution_ms([gap for result in done for gap in result.itl]),
        e2el_ms=distribution_ms([result.e2el for result in done]))
