"""Decode step time of the engine alone (no HTTP server, no event-loop load), with and without a
JSON-schema grammar on every request, to tell the grammar's cost on the model thread from what
serving adds around it. Runs an exported core in-process: C requests of random 1024-token
prompts, 256 output tokens each (ignore_eos); reports the median gap between a request's tokens
(ITL) in the decode phase, and with --profile the model thread's cumulative time per function.

    python3 benchmarks/engine_steps.py --config /tmp/flare-bench/config.toml --core qwen3-8b-random \
        --concurrency 64 --json-schema benchmarks/note_schema.json [--profile]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import functools
import io
import json
import pstats
import random
import statistics
import time
from pathlib import Path

import torch

from flare_core.cli import open_verified_core
from flare_core.config import load_config
from flare_core.frontend.grammar import GrammarKind, GrammarSpec
from flare_core.plugins import load_registry
from flare_core.runtime.build import build_engine
from flare_core.runtime.engine import Engine
from flare_core.runtime.loaded import load_core
from flare_core.runtime.memory import plan_kv
from flare_core.runtime.types import GenerationRequest, SamplingParams


async def run(engine: Engine, requests: list[GenerationRequest]) -> list[list[float]]:
    """Per request, the arrival times of its token events."""
    engine.start()
    try:
        async def times(stream) -> list[float]:
            arrivals = []
            async for event in stream:
                if event.token_ids:
                    arrivals.append(time.perf_counter())
            return arrivals

        return await asyncio.gather(*(times(engine.submit(r)) for r in requests))
    finally:
        await engine.aclose()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--core", required=True)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--json-schema", type=Path)
    parser.add_argument("--profile", action="store_true", help="cProfile the model thread (slows it)")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    config = load_config(args.config)
    device = torch.device(args.device)
    loaded = load_core(open_verified_core(config, args.core, trust_publisher=True), load_registry(), device)
    kv = functools.partial(plan_kv, loaded.cache_scheme, loaded.capacities, args.concurrency, device, "0.9", None)
    profile = cProfile.Profile()
    if args.profile:
        thread_run = Engine._run

        def profiled(self: Engine) -> None:
            profile.enable()
            try:
                thread_run(self)
            finally:
                profile.disable()

        Engine._run = profiled
    engine = build_engine(loaded, kv, load_registry(), max_concurrency=args.concurrency, queue_capacity=0)
    grammar = None
    if args.json_schema is not None:
        spec = GrammarSpec(GrammarKind.JSON_SCHEMA, args.json_schema.read_text(), "--json-schema")
        grammar = engine.frontend.grammars.compile(spec)
    rng = random.Random(0)
    vocab = engine.frontend.tokenizer.vocab_size
    requests = [GenerationRequest(prompt_ids=tuple(rng.randrange(1000, vocab - 1000) for _ in range(args.input_len)),
                                  max_tokens=args.output_len, ignore_eos=True, grammar=grammar,
                                  sampling=SamplingParams(temperature=1.0, seed=i))
                for i in range(args.concurrency)]
    arrivals = asyncio.run(run(engine, requests))
    # The decode phase: once every request has its first token, until the first one ends.
    start, end = max(a[0] for a in arrivals), min(a[-1] for a in arrivals)
    gaps = [b - a for times in arrivals for a, b in zip(times, times[1:]) if start <= a and b <= end]
    result = {"concurrency": args.concurrency, "grammar": grammar is not None, "profiled": args.profile,
              "tokens": sum(len(a) for a in arrivals), "decode_itl_median_ms": round(statistics.median(gaps) * 1e3, 3),
              "decode_itl_mean_ms": round(statistics.fmean(gaps) * 1e3, 3)}
    print(json.dumps(result))
    if args.profile:
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(
            "engine.py|grammar.py|scheduler.py|output.py|graphs.py|eager.py|sampling.py|token_masks.py", 40)
        print(text.getvalue())


if __name__ == "__main__":
    main()
