"""Decode step time of the engine alone (no HTTP server, no event-loop load), with and without a
JSON-schema grammar on every request, to tell the grammar's cost on the model thread from what
serving adds around it. Runs an exported core in-process: C requests of random 1024-token
prompts, 256 output tokens each (ignore_eos); reports the median gap between a request's tokens
(ITL) in the decode phase, and with --profile the host's cumulative time per function; with
--host-split, the host's time per step split into planning (the scheduler), launching (inputs,
attention plans, replays), reading back (output processing, events) and waiting for the device
(each step's HostTimes): a host that seldom waits sets the step time itself. The engine core is
driven step by step on the benchmark's own thread (EngineCore.step). Several concurrencies
(`--concurrency 1,64`) run one after another on one engine; with `--spec-method` the engine
speculates (each result then counts the drafts checked and kept while it ran).

    python3 benchmarks/engine_steps.py --config /tmp/flare-bench/config.toml --core qwen3-8b-random \
        --concurrency 64 --json-schema benchmarks/note_schema.json [--profile | --host-split]
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import json
import pstats
import random
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from flare_core.cli import open_verified_core
from flare_core.config import load_config
from flare_core.frontend.grammar import GrammarKind, GrammarSpec
from flare_core.plugins import load_registry
from flare_core.engine.build import build_engine
from flare_core.engine.core import EngineCore
from flare_core.engine.load import load_core
from flare_core.engine.memory import plan_kv
from flare_core.requests import GenerationRequest, SamplingParams


def run(core: EngineCore, rounds: list[list[GenerationRequest]], kernel_profile: Path | None,
        profile: cProfile.Profile | None, first: int = 0) -> list[tuple[list[list[float]], dict[str, float]]]:
    """Per round (its requests run together, the rounds one after another on one engine core,
    driven step by step on this thread): per request, the arrival times of its token events,
    and the round's host time per step by phase (HostTimes of the steps read back). The last
    round runs under the torch profiler when `kernel_profile` names a file for its per-kernel
    table; `profile` profiles the steps' host code. Rounds are numbered from `first` (their
    request ids)."""
    results = []
    for index, requests in enumerate(rounds, start=first):
        arrivals: dict[str, list[float]] = {}
        totals = {"steps": 0, "schedule": 0.0, "launch": 0.0, "read": 0.0, "wait": 0.0}
        for i, request in enumerate(requests):
            core.add(f"r{index}.{i}", request)
            arrivals[f"r{index}.{i}"] = []
        tracing = kernel_profile is not None and index == first + len(rounds) - 1
        if tracing:
            from torch.profiler import ProfilerActivity, profile as torch_profile

            tracer = torch_profile(activities=[ProfilerActivity.CUDA])
            tracer.__enter__()
        if profile is not None:
            profile.enable()
        while not core.is_idle():
            activity = core.step()
            now = time.perf_counter()
            for request_id, event in activity.events:
                if event.token_ids:
                    arrivals[request_id].append(now)
            for step in activity.steps:
                totals["steps"] += 1
                for name in ("schedule", "launch", "read", "wait"):
                    totals[name] += getattr(step.host, f"{name}_s")
        if profile is not None:
            profile.disable()
        if tracing:
            tracer.__exit__(None, None, None)
            kernel_profile.write_text(tracer.key_averages().table(sort_by="cuda_time_total", row_limit=50,
                                                                  max_name_column_width=90))
        results.append((list(arrivals.values()), totals))
    return results


def sampling_settings(text: str) -> SamplingParams:
    """SamplingParams from `temperature=0.7,top_k=20,top_p=0.8` (fields of SamplingParams)."""
    fields = dict(item.split("=") for item in text.split(",") if item)
    return SamplingParams(**{name: (int(value) if name == "top_k" else float(value)) for name, value in fields.items()})


def itl(arrivals: list[list[float]]) -> dict:
    """Median and mean gap between a request's tokens in the decode phase: once every request
    has its first token, until the first one ends."""
    start, end = max(a[0] for a in arrivals), min(a[-1] for a in arrivals)
    gaps = [b - a for times in arrivals for a, b in zip(times, times[1:]) if start <= a and b <= end]
    tokens = sum(len(a) for a in arrivals)
    span = max(a[-1] for a in arrivals) - min(a[0] for a in arrivals)
    return {"tokens": tokens, "decode_itl_median_ms": round(statistics.median(gaps) * 1e3, 3) if gaps else None,
            "decode_itl_mean_ms": round(statistics.fmean(gaps) * 1e3, 3) if gaps else None,
            "output_tok_s_after_first_tokens": round(tokens / span, 1) if span > 0 else None}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--core", required=True)
    parser.add_argument("--concurrency", default="64", help="one, or several one after another: 1,64")
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--json-schema", type=Path)
    parser.add_argument("--profile", action="store_true", help="cProfile the model thread (slows it)")
    parser.add_argument("--sampling", action="append",
                        help="a round of requests sampled so, e.g. temperature=0.7,top_k=20,top_p=0.8 (repeat "
                             "for rounds one after another on one engine; default temperature=1.0)")
    parser.add_argument("--kernel-profile", type=Path, help="write the last round's per-kernel device time here")
    parser.add_argument("--host-split", action="store_true",
                        help="time the model thread's planning, launching, reading back and waiting")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--spec-method", choices=["prompt-lookup"])
    parser.add_argument("--spec-draft-tokens", type=int, default=4)
    args = parser.parse_args()
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    config = load_config(args.config)
    device = torch.device(args.device)
    loaded = load_core(open_verified_core(config, args.core, trust_publisher=True), load_registry(), device)
    kv = functools.partial(plan_kv, loaded.cache_scheme, loaded.capacities, max(concurrencies), device, "0.9", None)
    profile = cProfile.Profile()
    engine = build_engine(loaded, kv, load_registry(), max_concurrency=max(concurrencies), queue_capacity=0,
                          spec_method=args.spec_method, spec_draft_tokens=args.spec_draft_tokens)
    print(engine.executor_summary(), flush=True)
    grammar = None
    if args.json_schema is not None:
        spec = GrammarSpec(GrammarKind.JSON_SCHEMA, args.json_schema.read_text(), "--json-schema")
        grammar = engine.frontend.grammars.compile(spec)
    rng = random.Random(0)
    vocab = engine.frontend.tokenizer.vocab_size
    settings = args.sampling or ["temperature=1.0"]
    shapes = [(concurrency, setting) for concurrency in concurrencies for setting in settings]
    rounds = [[GenerationRequest(prompt_ids=tuple(rng.randrange(1000, vocab - 1000) for _ in range(args.input_len)),
                                 max_tokens=args.output_len, ignore_eos=True, grammar=grammar,
                                 sampling=replace(sampling_settings(setting), seed=i))
               for i in range(concurrency)] for concurrency, setting in shapes]
    for index, ((concurrency, setting), requests) in enumerate(zip(shapes, rounds)):
        before = engine.resources()
        (arrivals, phases), = run(engine.core, [requests], args.kernel_profile, profile if args.profile else None,
                                  first=index)
        after = engine.resources()
        result = {"concurrency": concurrency, "grammar": grammar is not None, "profiled": args.profile,
                  "sampling": setting, "spec_method": args.spec_method, **itl(arrivals)}
        if args.spec_method:
            result.update({name: getattr(after, name) - getattr(before, name)
                           for name in ("drafts", "accepted_drafts", "draft_rounds")})
        if args.host_split:
            steps = phases.pop("steps")
            result["host_ms_per_step"] = {name: round(1e3 * seconds / steps, 4) for name, seconds in phases.items()}
        print(json.dumps(result))
    if args.profile:
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(
            "core.py|frames.py|live.py|grammar.py|scheduler.py|output.py|graphs.py|eager.py|sampling.py|token_masks.py", 40)
        print(text.getvalue())


if __name__ == "__main__":
    main()
