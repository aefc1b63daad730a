"""The printed result table and the JSON result file of a benchmark run."""

from __future__ import annotations

import dataclasses
import datetime
import math
from collections.abc import Mapping
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from flare_core.bench.metrics import BenchMetrics, Distribution, tpot
from flare_core.bench.runner import BenchRun

_WIDTH = 50
_LABEL = 40


def _rule(title: str = "", fill: str = "-") -> str:
    return f" {title} ".center(_WIDTH, fill) if title else fill * _WIDTH


def _row(label: str, value: Any) -> str:
    if isinstance(value, float):
        value = f"{value:.2f}"
    return f"{label + ':':<{_LABEL}}{value}"


def _latency_rows(title: str, short: str, values: Distribution | None) -> list[str]:
    rows = [_rule(title)]
    for name in ("mean", "median", "p99"):
        label = {"mean": "Mean", "median": "Median", "p99": "P99"}[name]
        rows.append(_row(f"{label} {short} (ms)", getattr(values, name) if values is not None else "-"))
    return rows


def format_table(metrics: BenchMetrics, *, max_concurrency: int | None, request_rate: float) -> str:
    rows = [
        _rule("Serving Benchmark Result", "="),
        _row("Successful requests", metrics.completed),
        _row("Failed requests", metrics.failed),
        _row("Maximum request concurrency", max_concurrency if max_concurrency is not None else "unlimited"),
        _row("Request rate (req/s)", "inf" if math.isinf(request_rate) else request_rate),
        _row("Benchmark duration (s)", metrics.duration_s),
        _row("Total input tokens", metrics.input_tokens),
        _row("Total generated tokens", metrics.output_tokens),
        _row("Request throughput (req/s)", metrics.request_throughput),
        _row("Output token throughput (tok/s)", metrics.output_throughput),
        _row("Total token throughput (tok/s)", metrics.total_token_throughput),
        _row("Prefix cache reuse (%)", metrics.prefix_reuse * 100),
        *_latency_rows("Time to First Token", "TTFT", metrics.ttft_ms),
        *_latency_rows("Time per Output Token (excl. 1st token)", "TPOT", metrics.tpot_ms),
        *_latency_rows("Inter-token Latency", "ITL", metrics.itl_ms),
        *_latency_rows("End-to-end Latency", "E2EL", metrics.e2el_ms),
        _rule(fill="="),
    ]
    return "\n".join(rows)


def _flare_version() -> str | None:
    try:
        return version("flare-core")
    except PackageNotFoundError:
        return None


def _json_safe(value: Any) -> Any:
    """Strict JSON has no Infinity: an unlimited request rate is written as "inf"."""
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    if isinstance(value, (list, tuple)):
        return [_json_safe(item) for item in value]
    if isinstance(value, Mapping):
        return {key: _json_safe(item) for key, item in value.items()}
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def result_json(run: BenchRun, metrics: BenchMetrics, config: Mapping[str, Any], base_url: str) -> dict[str, Any]:
    """Everything a run is compared by later: metrics, the command-line configuration, the server's
    models, and a summary line per request (its send time relative to the run's start)."""
    requests = []
    for result in run.results:
        per_request_tpot = tpot(result) if result.ok else None
        requests.append({
            "sent_s": result.started - run.started, "ok": result.ok, "error": result.error,
            "prompt_tokens": result.prompt_tokens, "output_tokens": result.output_tokens,
            "cached_tokens": result.cached_tokens,
            "ttft_ms": result.ttft * 1000 if result.ok else None, "e2el_ms": result.e2el * 1000,
            "tpot_ms": per_request_tpot * 1000 if per_request_tpot is not None else None,
        })
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "flare_version": _flare_version(),
        "config": _json_safe(dict(config)),
        "server": {"base_url": base_url, "models": run.models},
        "model": run.model,
        "metrics": dataclasses.asdict(metrics),
        "requests": requests,
    }
