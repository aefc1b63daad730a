"""Decode microbenchmark at concurrency 1, side by side with Hugging Face `generate`.

One process, one run, one set of random bf16 weights of a real shape (default: Qwen3-8B:
36 layers, hidden 4096, 32/8 heads, head_dim 128, vocab 151936):
  * the device copy bandwidth (a large device-to-device copy),
  * Flare decode tok/s through the CUDA executor (FlashInfer + captured decode graphs) with a
    `--context`-token context, greedy sampling and the token read back every step (as serving does),
  * the bandwidth roofline fraction: weight bytes x tok/s / bandwidth,
  * Hugging Face `generate` (dynamic cache, SDPA) on the same weights and prompt length.

    python benchmarks/decode_c1.py --out benchmarks/results/decode-c1.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import time
from pathlib import Path

import torch

from random_qwen3 import qwen3_config, random_hf_model


def copy_bandwidth(device: torch.device, gib: int = 4, repeats: int = 10) -> float:
    """Bytes moved per second by a device-to-device copy (read + write counted)."""
    src = torch.empty(gib * 2**30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    del src, dst
    return 2 * gib * 2**30 * repeats / seconds


def flare_decode(config, hf_model, device, context: int, steps: int) -> dict:
    from flare_core.contract import CacheScheme, PagedStore
    from flare_core.executor.graphs import GraphExecutor
    from flare_core.ops.loading import load_prepared_weights
    from flare_core.scheduler import DecodeEntry, PrefillChunk, RequestHandle, StepPlan
    from flare_core.scheduler.estimates import StepKind
    from flare_recipe_qwen.recipes import QWEN3

    prepared = dict(QWEN3.map_weights(config, hf_model.state_dict(), torch.bfloat16))
    model = QWEN3.build_model(config, torch.bfloat16)
    load_prepared_weights(model, prepared, device)
    del prepared
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    layers = config.num_hidden_layers
    scheme = CacheScheme("attention-kv", (PagedStore("k", (8, 128), "bfloat16", layers),
                                          PagedStore("v", (8, 128), "bfloat16", layers)))
    page_tokens, total = 64, context + steps + 1
    num_pages = -(-total // page_tokens) + 4
    started = time.perf_counter()
    executor = GraphExecutor(model, scheme, num_pages=num_pages, page_tokens=page_tokens, num_rows=1,
                             num_snapshot_slots=0, num_logits_slots=0, vocab_size=config.vocab_size, device=device,
                             decode_capacities=(1,), context_length=total)
    capture_s = time.perf_counter() - started
    handle = RequestHandle("bench", 0, 1)
    pages = tuple(range(num_pages))
    prompt = torch.randint(1000, 100000, (context,), generator=torch.Generator().manual_seed(0)).tolist()
    prefill = StepPlan(0, StepKind.PREFILL, context, (), (), (PrefillChunk(handle, 0, context, tuple(prompt), pages,
                                                                            True, None),), 0.0)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    token = int(executor.run(prefill).argmax(-1).item())
    ttft = time.perf_counter() - t0

    def decode(position: int, token: int) -> int:
        plan = StepPlan(position, StepKind.DECODE, 1, (), (DecodeEntry(handle, position, token, pages),), (), 0.0)
        return int(executor.run(plan).argmax(-1).item())

    for i in range(5):  # warm-up replays
        token = decode(context + i, token)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(steps):
        token = decode(context + 5 + i, token)
    seconds = time.perf_counter() - start
    return {"decode_c1_tok_s": steps / seconds, "decode_c1_ms_per_token": 1000 * seconds / steps,
            "weight_bytes": weight_bytes, "graph_capture_s": capture_s, "prefill_ttft_ms": 1000 * ttft}


def hf_generate(hf_model, device, context: int, new_tokens: int) -> float:
    prompt = torch.randint(1000, 100000, (1, context), generator=torch.Generator().manual_seed(0)).to(device)
    kwargs = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    hf_model.generate(prompt, max_new_tokens=4, min_new_tokens=4, **kwargs)  # warm-up
    timings = []
    for n in (1, new_tokens + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        hf_model.generate(prompt, max_new_tokens=n, min_new_tokens=n, **kwargs)
        torch.cuda.synchronize()
        timings.append(time.perf_counter() - start)
    return new_tokens / (timings[1] - timings[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=12288)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=256)
    parser.add_argument("--hf-new-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    device = torch.device("cuda")
    bandwidth = copy_bandwidth(device)
    config = qwen3_config(args.layers, args.hidden, args.intermediate)
    hf_model = random_hf_model(config, device)
    flare = flare_decode(config, hf_model, device, args.context, args.steps)
    hf_tok_s = hf_generate(hf_model, device, args.context, args.hf_new_tokens)
    roofline_tok_s = bandwidth / flare["weight_bytes"]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {
        **flare,
        "copy_bandwidth_gb_s": bandwidth / 1e9,
        "roofline_tok_s": roofline_tok_s,
        "roofline_fraction_c1": flare["decode_c1_tok_s"] / roofline_tok_s,
        "hf_generate_c1_tok_s": hf_tok_s,
        "speedup_vs_hf": flare["decode_c1_tok_s"] / hf_tok_s,
        "shape": {"layers": args.layers, "hidden": args.hidden, "intermediate": args.intermediate,
                  "heads": "32/8", "head_dim": 128, "vocab": 151936, "dtype": "bfloat16"},
        "context": args.context, "steps": args.steps, "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__, "commit": commit or None,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
