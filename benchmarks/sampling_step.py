"""Device time of the samplers the CUDA executor captures, side by side in one process: the
compiled windowed sampler (`sample_rows` with the top-64 window, as flare_core.executor.graphs
compiles it) with flare_core.executor.sampling's `first_argmax` (one row in 128 slices) and with a
plain `argmax` over the whole row, at a few batch sizes; each replayed in a CUDA graph of
`--repeats` calls over one logits buffer. With --top-values, ways to take one row's 64 largest
values (torch.topk whole or over slices, sorts), which the windowed sampler needs.

    python3 benchmarks/sampling_step.py --vocab 151936 --batch 1 64 --out benchmarks/results/sampling-step.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from moe_decode import graph_us
from provenance import commit_and_date, report

import flare_core.executor.sampling as sampling

WINDOW = 64


def per_call_us(fn, calls: int) -> float:
    """Microseconds per call of `fn` captured `calls` times in one CUDA graph."""
    return graph_us(lambda: [fn() for _ in range(calls)], 5) / calls


def top_value_variants(vocab: int, device: torch.device) -> dict[str, float]:
    """Microseconds per call of ways to get one row's 64 largest values (descending), each
    checked against x.topk(64)."""
    x = torch.randn(1, vocab, device=device, generator=torch.Generator(device=device).manual_seed(1)) * 3
    want = x.topk(WINDOW, dim=-1).values

    def sliced(count: int, sort_slices: bool, sort_candidates: bool):
        size = -(-vocab // count)

        def fn():
            slices = torch.nn.functional.pad(x, (0, count * size - vocab), value=float("-inf")).view(1, count, size)
            if sort_slices:
                candidates = slices.sort(dim=-1, descending=True).values[..., :WINDOW]
            else:
                candidates = slices.topk(WINDOW, dim=-1).values
            candidates = candidates.flatten(1)
            if sort_candidates:
                return candidates.sort(dim=-1, descending=True).values[:, :WINDOW]
            return candidates.topk(WINDOW, dim=-1).values
        return fn

    variants = {"topk": lambda: x.topk(WINDOW, dim=-1).values}
    for count in (32, 128, 512):
        for sort_slices in (False, True):
            for sort_candidates in (False, True):
                name = f"{count}_slices_{'sort' if sort_slices else 'topk'}_then_{'sort' if sort_candidates else 'topk'}"
                variants[name] = sliced(count, sort_slices, sort_candidates)
    timings = {}
    for name, fn in variants.items():
        assert torch.equal(fn(), want), name
        timings[name] = round(per_call_us(fn, 50), 2)
    return timings


def windowed_sampler(batch: int, vocab: int, device: torch.device):
    generator = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(batch, vocab, device=device, generator=generator) * 3
    columns = dict(temperature=torch.full((batch,), 0.6, device=device), top_k=torch.full((batch,), 20, device=device),
                   top_p=torch.full((batch,), 0.95, device=device), min_p=torch.zeros(batch, device=device),
                   seeds=torch.arange(batch, device=device), steps=torch.zeros(batch, dtype=torch.int64, device=device),
                   seeded=torch.ones(batch, dtype=torch.bool, device=device),
                   unseeded_seed=torch.tensor(3, device=device))
    compiled = torch.compile(sampling.sample_rows, dynamic=True)
    return lambda: compiled(logits, candidates=WINDOW, **columns), logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--top-values", action="store_true", help="also time ways to take one row's 64 largest")
    parser.add_argument("--profile", type=Path, help="write the per-kernel table of the first batch's samplers here")
    args = parser.parse_args()
    device = torch.device("cuda")
    results: dict[str, dict] = {}
    for batch in args.batch:
        row = results[f"batch_{batch}"] = {}
        # Plain first, then the module's own: each compiled afresh.
        sliced_argmax, sampling.first_argmax = sampling.first_argmax, lambda x: x.argmax(dim=-1)
        torch._dynamo.reset()
        plain, logits = windowed_sampler(batch, args.vocab, device)
        row["windowed_plain_us"] = per_call_us(plain, args.repeats)
        plain_tokens = plain().clone()
        sampling.first_argmax = sliced_argmax
        torch._dynamo.reset()
        sliced, _ = windowed_sampler(batch, args.vocab, device)
        row["windowed_sliced_us"] = per_call_us(sliced, args.repeats)
        row["same_tokens"] = bool(torch.equal(sliced(), plain_tokens))
        row["greedy_argmax_us"] = per_call_us(lambda: logits.argmax(dim=-1), args.repeats)
        if args.profile is not None and batch == args.batch[0]:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    sliced()
                torch.cuda.synchronize()
            args.profile.write_text(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25,
                                                              max_name_column_width=100))
        print(batch, row, flush=True)
    if args.top_values:
        results["top_values_batch_1_us"] = top_value_variants(args.vocab, device)
        print(results["top_values_batch_1_us"], flush=True)
    report({"vocab": args.vocab, "window": WINDOW, "sampling": "temperature 0.6, top_k 20, top_p 0.95, seeded",
            "results": results, "device": torch.cuda.get_device_name(device), "torch": torch.__version__,
            **commit_and_date(), "command": " ".join(["python3 benchmarks/sampling_step.py", *sys.argv[1:]])}, args.out)


if __name__ == "__main__":
    main()
