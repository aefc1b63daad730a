"""What a speculative round costs against a plain decode step, on the executor alone: for R rows at a
C-token context, the device time of a decode step (the decode graph of R rows) and of a round in
which every row checks D drafts (the speculative graph of R x (1 + D) tokens), greedy sampling
inside both, back to back with the host ahead of the device as in serving. From the ratio and a
number of drafts kept per round, the speedup a request decoding alone would see if every step
were such a round: (1 + kept) / ratio.

    python3 benchmarks/speculative_round.py --config /tmp/flare-bench/config.toml --core CORE \\
        [--rows 1,2,4,8,12] [--drafts 1,2,4,8] [--context 1024] [--kept 2.67] [--out results.json]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import pathlib
import subprocess

import torch

from flare_core.cli import open_verified_core
from flare_core.config import load_config
from flare_core.engine.build import build_engine
from flare_core.engine.load import load_core
from flare_core.engine.memory import plan_kv
from flare_core.executor.sampling import StepSampling
from flare_core.plugins import load_registry
from flare_core.requests import SamplingParams
from flare_core.scheduler import DecodeEntry, RequestHandle, StepKind, StepPlan


def plan_of(rows: int, drafts: int, context: int, page_tokens: int) -> StepPlan:
    """R decode rows at position `context`, each over pages of its own, checking `drafts` drafts."""
    pages = -(-(context + 1 + drafts) // page_tokens)
    decodes = tuple(DecodeEntry(RequestHandle(f"r{r}", r, 0), context, 1000 + r,
                                tuple(range(r * pages, (r + 1) * pages)), tuple(range(2000, 2000 + drafts)))
                    for r in range(rows))
    kind = StepKind.SPECULATIVE if drafts else StepKind.DECODE
    return StepPlan(0, kind, 0, (), decodes, (), 0.0)


def device_ms(executor, plan: StepPlan, iterations: int) -> float:
    """Mean device time per step of `plan`, issued back to back."""
    sampling = StepSampling(params=[SamplingParams(temperature=0.0)] * len(plan.samples),
                            steps=[0] * len(plan.samples), penalties=[None] * len(plan.samples))
    for _ in range(5):
        executor.step(plan, sampling)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iterations):
        executor.step(plan, sampling)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iterations


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", type=pathlib.Path, required=True)
    parser.add_argument("--core", required=True)
    parser.add_argument("--rows", default="1,2,4,8,12")
    parser.add_argument("--drafts", default="1,2,4,8")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--iterations", type=int, default=100)
    parser.add_argument("--kept", default="2:1.57,4:2.67,8:4.5",
                        help="drafts kept per round by width, for the projection (WIDTH:KEPT,...)")
    parser.add_argument("--out", type=pathlib.Path)
    args = parser.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    drafts_list = [int(d) for d in args.drafts.split(",")]
    kept = {int(w): float(k) for w, k in (item.split(":") for item in args.kept.split(",") if item)}
    config = load_config(args.config)
    device = torch.device("cuda")
    loaded = load_core(open_verified_core(config, args.core, trust_publisher=True), load_registry(), device)
    concurrency = max(rows_list)
    kv = functools.partial(plan_kv, loaded.cache_scheme, loaded.capacities, concurrency, device, "0.9", None)
    engine = build_engine(loaded, kv, load_registry(), max_concurrency=concurrency, queue_capacity=0,
                          spec_method="prompt-lookup", spec_draft_tokens=max(drafts_list))
    executor = engine.core.executor
    print(engine.executor_summary(), flush=True)
    page_tokens = loaded.capacities.page_tokens
    largest = max(executor.graphs.speculative_graphs)
    results = []
    for rows in rows_list:
        plain = device_ms(executor, plan_of(rows, 0, args.context, page_tokens), args.iterations)
        for drafts in drafts_list:
            tokens = rows * (1 + drafts)
            if tokens > largest:
                continue
            round_ms = device_ms(executor, plan_of(rows, drafts, args.context, page_tokens), args.iterations)
            ratio = round_ms / plain
            row = {"rows": rows, "drafts": drafts, "tokens": tokens, "decode_ms": round(plain, 4),
                   "round_ms": round(round_ms, 4), "round_over_decode": round(ratio, 4),
                   "kept_per_round": kept.get(drafts),
                   "projected_speedup": round((1 + kept[drafts]) / ratio, 3) if drafts in kept else None}
            results.append(row)
            print(json.dumps(row), flush=True)
    if args.out is not None:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        args.out.write_text(json.dumps({
            "command": "python3 benchmarks/speculative_round.py " + " ".join(
                f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k not in ("config", "out")),
            "commit": commit, "date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
            "core": str(args.core), "context": args.context,
            "summary": engine.executor_summary(), "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
