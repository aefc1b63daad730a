"""An engine served in the test's own process (no `flare run`, no HTTP): `make_engine` builds one
from an exported core as `flare run` would, and `run_requests` drives a list of requests through it
concurrently and collects each one's tokens, logprobs, finish reason and usage."""

from __future__ import annotations

import asyncio
import functools

import torch

from flare_core.config import load_config
from flare_core.engine.build import build_engine
from flare_core.engine.load import load_core
from flare_core.engine.memory import plan_kv
from flare_core.engine.service import Engine
from flare_core.plugins import load_registry


def make_engine(flare, core_path, frames: int, device: str = "cpu", compile_model: bool = False,
                kv_pages: int | None = None, **options) -> Engine:
    """The engine of the core at `core_path` under `flare`'s config (a `flare_testing.server.Flare`),
    not started: four state rows, `frames` steps in flight, a 64 MiB page pool unless `kv_pages`;
    `options` go to `build_engine`."""
    from flare_core.cli import open_verified_core

    config = load_config(flare.config_path)
    loaded = load_core(open_verified_core(config, str(core_path), trust_publisher=True), load_registry(),
                       torch.device(device))
    kv_limit = "64M" if kv_pages is None else str(kv_pages * loaded.cache_scheme.page_bytes(
        loaded.capacities.page_tokens))
    kv = functools.partial(plan_kv, loaded.cache_scheme, loaded.capacities, 4, torch.device(device), "0.9", kv_limit)
    return build_engine(loaded, kv, load_registry(), max_concurrency=4, queue_capacity=8, frames_in_flight=frames,
                        compile_model=compile_model, **options)


async def run_requests(engine: Engine, requests, cancel_after: dict[int, int] | None = None):
    """Start `engine`, submit every request at once and return, per request, (tokens, logprobs as
    (token id, logprob to 4 places, top ids), finish reason, usage); request i is cancelled once it
    has `cancel_after[i]` tokens. The engine is closed after."""
    engine.start()
    try:
        streams = [engine.submit(r) for r in requests]

        async def collect(i, stream):
            tokens, logprobs, last = [], [], None
            async for event in stream:
                tokens.extend(event.token_ids)
                logprobs.extend((lp.token_id, round(lp.logprob, 4), tuple(t[0] for t in lp.top))
                                for lp in event.logprobs)
                if cancel_after and i in cancel_after and len(tokens) >= cancel_after[i]:
                    stream.cancel()
                last = event
            return tokens, logprobs, last.finish_reason, last.usage

        return await asyncio.gather(*(collect(i, s) for i, s in enumerate(streams)))
    finally:
        await engine.aclose()
