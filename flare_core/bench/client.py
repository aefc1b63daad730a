"""One streamed request against an OpenAI-compatible server, timed on the client side.

Token counts come from the stream's final usage chunk (`stream_options.include_usage`): a
chunk may carry several tokens, and tokens with no text (special tokens, split UTF-8
characters) send no chunk. Chunk arrival times give TTFT (first chunk with output) and the
inter-chunk latencies.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from flare_core.bench.datasets import BenchRequest

_ERROR_TEXT_LIMIT = 500


class BenchError(RuntimeError):
    """The benchmark cannot run (server unreachable, unknown model, failing warmup)."""


@dataclass(frozen=True)
class Target:
    base_url: str
    model: str
    headers: Mapping[str, str]
    ignore_eos: bool


@dataclass(frozen=True)
class RequestResult:
    """Timings are seconds: `started` on the perf_counter clock, the others relative to it."""

    started: float
    ok: bool
    error: str | None = None
    ttft: float = 0.0
    e2el: float = 0.0
    itl: tuple[float, ...] = ()
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0


def request_body(request: BenchRequest, target: Target) -> dict[str, Any]:
    body = {**request.body, "model": target.model, "stream": True, "stream_options": {"include_usage": True}}
    if target.ignore_eos:
        body["ignore_eos"] = True  # vLLM's extension, which Flare accepts too
    return body


def _has_output(chunk: Mapping[str, Any]) -> bool:
    """Whether a chunk carries generated output (not the chat role chunk, not the finish chunk)."""
    for choice in chunk.get("choices") or ():
        if choice.get("text"):
            return True
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning") or delta.get("tool_calls"):
            return True
    return False


async def send_request(session: aiohttp.ClientSession, target: Target, request: BenchRequest) -> RequestResult:
    started = time.perf_counter()

    def failed(error: str) -> RequestResult:
        return RequestResult(started, ok=False, error=error, e2el=time.perf_counter() - started)

    arrivals: list[float] = []
    usage: Mapping[str, Any] | None = None
    try:
        async with session.post(target.base_url + request.path, json=request_body(request, target),
                                headers=target.headers) as response:
            if response.status != 200:
                text = (await response.text())[:_ERROR_TEXT_LIMIT]
                return failed(f"HTTP {response.status}: {text}")
            async for raw_line in response.content:
                line = raw_line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[len(b"data:"):].strip()
                if data == b"[DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if "error" in chunk:
                    return failed(f"error event: {json.dumps(chunk['error'])[:_ERROR_TEXT_LIMIT]}")
                if _has_output(chunk):
                    arrivals.append(now)
                if chunk.get("usage"):
                    usage = chunk["usage"]
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as exc:
        return failed(f"{type(exc).__name__}: {exc}")
    ended = time.perf_counter()
    if usage is None:
        return failed("the stream ended without a usage chunk (stream_options.include_usage unsupported?)")
    e2el = ended - started
    first = arrivals[0] if arrivals else ended
    details = usage.get("prompt_tokens_details") or {}
    return RequestResult(
        started, ok=True, ttft=first - started, e2el=e2el,
        itl=tuple(later - earlier for earlier, later in zip(arrivals, arrivals[1:])),
        prompt_tokens=int(usage.get("prompt_tokens") or 0), output_tokens=int(usage.get("completion_tokens") or 0),
        cached_tokens=int(details.get("cached_tokens") or 0))


async def fetch_models(session: aiohttp.ClientSession, base_url: str, headers: Mapping[str, str]) -> dict[str, Any]:
    """The server's /v1/models answer."""
    url = base_url + "/v1/models"
    try:
        async with session.get(url, headers=headers) as response:
            if response.status != 200:
                raise BenchError(f"GET {url}: HTTP {response.status}: {(await response.text())[:_ERROR_TEXT_LIMIT]}")
            models = await response.json()
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as exc:
        raise BenchError(f"GET {url} failed: {type(exc).__name__}: {exc}") from exc
    if not isinstance(models, dict) or not isinstance(models.get("data"), list) or not models["data"]:
        raise BenchError(f"GET {url}: expected a model list with at least one model, got {str(models)[:200]}")
    return models
