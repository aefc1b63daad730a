"""Driving the load: optional warmups, then every request sent on its arrival schedule under an
optional concurrency limit.

Arrivals follow a Poisson process of `request_rate` requests/s (exponential gaps from a seeded
RNG, so a run is repeatable); an infinite rate sends everything at once. A request waiting for a
concurrency slot is not yet sent: its TTFT starts when it is.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Callable, Union

import aiohttp

from flare_core.bench.client import BenchError, RequestResult, Target, fetch_models, send_request
from flare_core.bench.datasets import BenchRequest

_CONNECT_TIMEOUT_S = 30.0
# The requests to send, or how to build them from the served model's /v1/models card.
Workload = Union[Sequence[BenchRequest], Callable[[Mapping[str, Any]], Sequence[BenchRequest]]]


@dataclass(frozen=True)
class BenchRun:
    model: str
    models: dict[str, Any]  # the server's /v1/models answer
    results: list[RequestResult]  # in request order
    started: float  # perf_counter time of the first send
    duration_s: float  # first send to last completion


def arrival_offsets(count: int, request_rate: float, seed: int) -> list[float]:
    """Send times in seconds after the start, the first at 0."""
    if math.isnan(request_rate) or request_rate <= 0:
        raise ValueError(f"request rate must be positive (or inf), got {request_rate}")
    if math.isinf(request_rate):
        return [0.0] * count
    rng = random.Random(seed)
    offsets, now = [], 0.0
    for _ in range(count):
        offsets.append(now)
        now += rng.expovariate(request_rate)
    return offsets


def normalize_base_url(base_url: str) -> str:
    """'http://host:8000', also when given with a trailing '/' or '/v1' (the OpenAI SDK's spelling)."""
    return base_url.rstrip("/").removesuffix("/v1")


def _choose_model(models: Mapping[str, Any], requested: str | None) -> str:
    served = [str(card.get("id")) for card in models["data"]]
    if requested is None:
        return served[0]
    if requested not in served:
        raise BenchError(f"--model {requested!r}: the server serves {', '.join(served)}")
    return requested


async def run_benchmark(base_url: str, requests: Workload, *, model: str | None = None,
                        headers: Mapping[str, str] | None = None, ignore_eos: bool = False,
                        max_concurrency: int | None = None, request_rate: float = math.inf, seed: int = 0,
                        num_warmups: int = 0) -> BenchRun:
    """Send `requests` to the server at `base_url`; `model` defaults to its first served model.
    `requests` may be a function of the chosen model's /v1/models card (its vocabulary bounds
    synthetic token ids). Warmups (the first requests, not measured) must succeed: they check
    the server works."""
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max concurrency must be at least 1, got {max_concurrency}")
    base_url = normalize_base_url(base_url)
    headers = dict(headers or {})
    connector = aiohttp.TCPConnector(limit=max_concurrency or 0)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=_CONNECT_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        models = await fetch_models(session, base_url, headers)
        target = Target(base_url, _choose_model(models, model), headers, ignore_eos)
        if callable(requests):
            requests = requests(next(card for card in models["data"] if str(card.get("id")) == target.model))
        if not requests:
            raise ValueError("a benchmark needs at least one request")
        offsets = arrival_offsets(len(requests), request_rate, seed)
        for index in range(num_warmups):
            warmup = await send_request(session, target, requests[index % len(requests)])
            if not warmup.ok:
                raise BenchError(f"warmup request {index + 1} failed: {warmup.error}")

        slots = asyncio.Semaphore(max_concurrency) if max_concurrency is not None else None

        async def send(request: BenchRequest) -> RequestResult:
            if slots is None:
                return await send_request(session, target, request)
            async with slots:
                return await send_request(session, target, request)

        started = time.perf_counter()
        tasks = []
        for offset, request in zip(offsets, requests):
            delay = started + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(send(request)))
        results = list(await asyncio.gather(*tasks))
        duration_s = time.perf_counter() - started
    return BenchRun(target.model, models, results, started, duration_s)
