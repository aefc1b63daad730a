"""The scheduler alone under a closed-loop serving load with step costs shaped like a GPU's: the
check, without a GPU, that a scheduling policy does not cost throughput or latency. c=64
requests of random 1024-token prompts and 256 output tokens (a finished request is replaced at
once, as `flare bench --max-concurrency 64` does), the Qwen3-8B core's catalog (decode rows
1-64, prefill and mixed capacities 64-2048, chunk 2048) and step seconds from the H100's figures
(decode: 6 ms + 0.08 ms a row, 11 ms at 64 rows; prefill and mixed: 6 ms + 22 us a token of
capacity, 51 ms at 2048). Requests come from CLIENTS client addresses in turn (service prices
weigh clients against one another). Prints output tokens per simulated second, TTFT and ITL.

    python3 benchmarks/scheduler_sim.py [--clients N] [--requests 1500] [--tree PATH]

`--tree` runs another checkout's scheduler (an A/B of two commits).
"""

from __future__ import annotations

import argparse
import hashlib
import random
import sys


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--clients", type=int, default=1)
    parser.add_argument("--requests", type=int, default=1500, help="completed requests to simulate")
    parser.add_argument("--tree", help="a checkout whose flare_core to run")
    args = parser.parse_args()
    if args.tree:
        sys.path.insert(0, args.tree)
    from flare_core.kv import KvCacheManager, PageAllocator, PrefixCache
    from flare_core.scheduler import GraphCapacities, Scheduler, SchedulerConfig, StepCostEstimator, StepKind, StepResult

    def cost(plan) -> float:
        if plan.kind is StepKind.DECODE:
            return 0.006 + 0.00008 * len(plan.decodes)
        return 0.006 + 0.000022 * plan.capacity

    page_tokens, rows = 64, 64
    pages = PageAllocator(rows * 22 + 200)
    prefix = PrefixCache(hashlib.sha256(b"sim").digest(), pages, page_tokens, continuation_state=False,
                         snapshot_rows=0, logits_rows=4 * rows)
    capacities = (64, 128, 256, 512, 1024, 2048)
    config = SchedulerConfig(rows, 2048, GraphCapacities((1, 2, 4, 8, 16, 32, 64), capacities, capacities),
                             page_tokens)
    scheduler = Scheduler(config, KvCacheManager(pages, rows, page_tokens, prefix), StepCostEstimator())
    rng = random.Random(0)
    clock, count, submitted, first, last, gaps = 0.0, {}, {}, {}, {}, []
    done, tokens, pending = 0, 0, []

    def submit(n: int) -> None:
        request_id = f"r{n}"
        group = f"client{n % args.clients}"
        prompt = [rng.randrange(1000, 50_000) for _ in range(1024)]
        try:
            scheduler.submit(request_id, prompt, 256, group=group, client=group)
        except TypeError:   # a tree from before service prices
            scheduler.submit(request_id, prompt, 256)
        submitted[request_id], count[request_id] = clock, 0

    for n in range(rows):
        submit(n)
    next_id = rows
    while done < args.requests:
        plan = scheduler.schedule()
        if plan is not None:
            pending.append(plan)
        if plan is None or len(pending) >= 2:   # two steps in flight, as the CUDA executor keeps
            oldest = pending.pop(0)
            seconds = cost(oldest)
            clock += seconds
            for sample in scheduler.complete(oldest, StepResult([1] * len(oldest.samples), seconds)):
                request_id = sample.handle.request_id
                if request_id in first:
                    gaps.append(clock - last[request_id])
                else:
                    first[request_id] = clock
                last[request_id], count[request_id], tokens = clock, count[request_id] + 1, tokens + 1
                if count[request_id] == 256:
                    scheduler.finish(request_id, "length")
                    done += 1
                    submit(next_id)
                    next_id += 1
    ttft = sorted(first[r] - submitted[r] for r in first)
    gaps.sort()
    print(f"clients {args.clients}: output {tokens / clock:.0f} tok/s, TTFT p50 {1e3 * ttft[len(ttft) // 2]:.1f} ms "
          f"p99 {1e3 * ttft[int(len(ttft) * 0.99)]:.1f} ms, ITL p50 {1e3 * gaps[len(gaps) // 2]:.1f} ms p99 "
          f"{1e3 * gaps[int(len(gaps) * 0.99)]:.1f} ms, preemptions {scheduler.preemptions}")


if __name__ == "__main__":
    main()
