"""Decode microbenchmark at concurrency 1, side by side with Hugging Face `generate`.

One process, one run, one set of random bf16 weights of a real shape (default: Qwen3-8B:
36 layers, hidden 4096, 32/8 heads, head_dim 128, vocab 151936):
  * the device copy bandwidth (a large device-to-device copy),
  * Flare decode tok/s through the CUDA executor (FlashInfer + captured decode graphs) with a
    `--context`-token context, greedy sampling inside the graph and the token read back every
    step with two steps in flight (as serving does), for each of VARIANTS side by side: the
    model as captured, compiled then captured with cuBLAS matmuls, compiled then captured with
    the one-token GEMV kernel, and that with the Triton decode attention instead of FlashInfer's;
    their first tokens are reported next to the eager reference's,
  * the bandwidth roofline fraction: weight bytes x tok/s / bandwidth, and counting the KV cache
    a step reads too (at the timed steps' mean context: what matters at long contexts, `--context
    32768`),
  * Hugging Face `generate` (dynamic cache, SDPA) on the same weights and prompt length.

    python benchmarks/decode_c1.py --out benchmarks/results/decode-c1.json
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from provenance import commit_and_date, report
from random_qwen3 import qwen3_config, random_hf_model


# (name, compile the decoder layers, one-token matmuls through the GEMV kernel, one-token attention
# through the Triton decode kernels instead of FlashInfer's, FP8 weights), run in this order. The
# FP8 variant quantizes the decoder layers' linear weights as `flare export --quantize fp8` does.
VARIANTS = (("not compiled", False, False, False, False), ("compiled, cuBLAS", True, False, False, False),
            ("compiled, GEMV", True, True, False, False), ("compiled, GEMV, Triton attention", True, True, True, False),
            ("compiled, GEMV, FP8 weights", True, True, False, True))


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


def flare_decode(config, model, weight_bytes: int, device, context: int, steps: int, compile_model: bool,
                 triton_attention: bool, profile: Path | None = None) -> dict:
    """Decode at concurrency 1 the way the engine runs it: two steps in flight, each step's
    input token read on the device from the step before, its sampled token copied back to the
    host and read one step later."""
    from flare_core.contract import CacheScheme, PagedStore
    from flare_core.executor.graphs import cuda_runner
    from flare_core.executor.sampling import StepSampling
    from flare_core.requests import SamplingParams
    from flare_core.scheduler import DecodeEntry, PrefillChunk, RequestHandle, StepPlan
    from flare_core.scheduler.estimates import StepKind

    layers = config.num_hidden_layers
    scheme = CacheScheme("attention-kv", (PagedStore("k", (8, 128), "bfloat16", layers),
                                          PagedStore("v", (8, 128), "bfloat16", layers)))
    page_tokens, total = 64, context + steps + 48
    num_pages = -(-total // page_tokens) + 4
    started = time.perf_counter()
    executor = cuda_runner(model, scheme, num_pages=num_pages, page_tokens=page_tokens, num_rows=1,
                             num_snapshot_rows=0, num_logits_rows=0, vocab_size=config.vocab_size, device=device,
                             decode_capacities=(1,), context_length=total, compile_model=compile_model,
                             triton_attention=triton_attention)
    startup_s = time.perf_counter() - started
    handle = RequestHandle("bench", 0, 1)
    pages = tuple(range(num_pages))
    prompt = torch.randint(1000, 100000, (context,), generator=torch.Generator().manual_seed(0)).tolist()
    prefill = StepPlan(0, StepKind.PREFILL, context, (), (), (PrefillChunk(handle, 0, context, tuple(prompt), pages,
                                                                            True, None),), 0.0)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    first = executor.run(prefill).argmax(-1)
    executor.record_sampled([0], first)
    first_token = int(first.item())
    ttft = time.perf_counter() - t0

    greedy = StepSampling([SamplingParams(temperature=0.0)], [0], [None])

    def launch(position: int):
        plan = StepPlan(position, StepKind.DECODE, 1, (), (DecodeEntry(handle, position, None, pages),), (), 0.0)
        token = executor.step(plan, greedy).token_ids  # sampled inside the decode graph
        host = token.to("cpu", non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return host, done

    def run(first_position: int, count: int) -> list[int]:
        tokens, pending = [], launch(first_position)
        for i in range(1, count):
            following = launch(first_position + i)
            pending[1].synchronize()
            tokens.append(int(pending[0][0]))
            pending = following
        pending[1].synchronize()
        return tokens + [int(pending[0][0])]

    run(context, 8)  # warm-up replays
    torch.cuda.synchronize()
    start = time.perf_counter()
    tokens = run(context + 8, steps)
    seconds = time.perf_counter() - start
    if profile is not None:  # where a step's device time goes, by kernel
        from torch.profiler import ProfilerActivity, profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            run(context + 8 + steps, 20)
        profile.write_text(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=90))
    return {"decode_c1_tok_s": steps / seconds, "decode_c1_ms_per_token": 1000 * seconds / steps,
            "weight_bytes": weight_bytes, "compile_and_capture_s": startup_s, "compile_s": executor.graphs.compile_s,
            "prefill_ttft_ms": 1000 * ttft, "first_tokens": [first_token, *tokens[:8]]}


def eager_greedy(model, device, context: int, steps: int) -> list[int]:
    """The first greedy tokens through the eager reference executor on the same weights: the
    graph paths above must produce the same ones (bf16 ties aside)."""
    from flare_core.contract import CacheScheme, PagedStore
    from flare_core.executor.runner import eager_runner
    from flare_core.scheduler import DecodeEntry, PrefillChunk, RequestHandle, StepPlan
    from flare_core.scheduler.estimates import StepKind

    layers = model.model.config.num_hidden_layers
    scheme = CacheScheme("attention-kv", (PagedStore("k", (8, 128), "bfloat16", layers),
                                          PagedStore("v", (8, 128), "bfloat16", layers)))
    num_pages = -(-(context + steps + 1) // 64)
    executor = eager_runner(model, scheme, num_pages=num_pages, page_tokens=64, num_rows=1, num_snapshot_rows=0,
                             num_logits_rows=0, vocab_size=model.model.embed_tokens.weight.shape[0], device=device)
    handle, pages = RequestHandle("reference", 0, 1), tuple(range(num_pages))
    prompt = torch.randint(1000, 100000, (context,), generator=torch.Generator().manual_seed(0)).tolist()
    plan = StepPlan(0, StepKind.PREFILL, context, (), (), (PrefillChunk(handle, 0, context, tuple(prompt), pages,
                                                                         True, None),), 0.0)
    tokens = [int(executor.run(plan).argmax(-1).item())]
    for i in range(steps - 1):
        plan = StepPlan(i + 1, StepKind.DECODE, 1, (), (DecodeEntry(handle, context + i, tokens[-1], pages),), (), 0.0)
        tokens.append(int(executor.run(plan).argmax(-1).item()))
    return tokens


def serving_model(config, hf_model, device, fp8: bool = False, gemv: bool = True):
    from flare_core.kernels.fp8 import quantize_blocks
    from flare_core.ops import serving
    from flare_core.ops.fp8 import quantizable_linears
    from flare_core.ops.loading import load_prepared_weights
    from flare_recipe_qwen.recipes import QWEN3

    prepared = dict(QWEN3.map_weights(config, hf_model.state_dict(), torch.bfloat16))
    paths = quantizable_linears(QWEN3.build_model(config, torch.bfloat16)) if fp8 else []
    for path in paths:
        weight, scale_inv = quantize_blocks(prepared[path + ".weight"].to(device))
        prepared[path + ".weight"], prepared[path + ".weight_scale_inv"] = weight, scale_inv
    options = serving.ServingOptions(gemv=gemv, fp8_linears=tuple(paths))
    return load_prepared_weights(serving.serving_model(QWEN3, config, torch.bfloat16, options), prepared, device)


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
    parser.add_argument("--profile", type=Path, help="write a per-kernel table of 20 compiled decode steps here")
    parser.add_argument("--variants", help="names of VARIANTS to run, separated by '|' (default: all)")
    args = parser.parse_args()
    chosen = [v for v in VARIANTS if args.variants is None or v[0] in args.variants.split("|")]
    device = torch.device("cuda")
    bandwidth = copy_bandwidth(device)
    config = qwen3_config(args.layers, args.hidden, args.intermediate)
    hf_model = random_hf_model(config, device)
    hf_tok_s = hf_generate(hf_model, device, args.context, args.hf_new_tokens)
    reference_tokens: list[int] = []
    variants: dict[str, dict] = {}
    # Each variant on its own model, built with or without the GEMV kernel.
    for name, compile_model, gemv, triton_attention, fp8 in chosen:
        model = serving_model(config, hf_model, device, fp8, gemv)
        weight_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        if not reference_tokens:
            reference_tokens = eager_greedy(model, device, args.context, 9)
        variants[name] = flare_decode(config, model, weight_bytes, device, args.context, args.steps,
                                      compile_model=compile_model, triton_attention=triton_attention,
                                      profile=args.profile if name == chosen[-1][0] else None)
        variants[name]["fp8"] = fp8
        print(name, round(variants[name]["decode_c1_tok_s"], 1), "tok/s", flush=True)
        del model
        torch.cuda.empty_cache()
    bf16 = [name for name in variants if not variants[name]["fp8"]] or list(variants)
    best = max(bf16, key=lambda name: variants[name]["decode_c1_tok_s"])
    flare = variants[best]
    weight_bytes = flare["weight_bytes"]
    roofline_tok_s = bandwidth / weight_bytes
    # K and V of every layer at each position a timed step attends over (8 KV heads of 128, bf16).
    kv_bytes = args.layers * 2 * 8 * 128 * 2 * (args.context + 8 + args.steps / 2)
    fp8 = [name for name in variants if variants[name]["fp8"]]
    result = {
        **flare,
        "variant": best,
        "variants": {name: {"tok_s": v["decode_c1_tok_s"], "weight_bytes": v["weight_bytes"],
                            "roofline_fraction": v["decode_c1_tok_s"] * v["weight_bytes"] / bandwidth,
                            "first_tokens": v["first_tokens"], "compile_and_capture_s": v["compile_and_capture_s"]}
                     for name, v in variants.items()},
        **({"decode_c1_tok_s_fp8": variants[fp8[0]]["decode_c1_tok_s"],
            "roofline_fraction_fp8": variants[fp8[0]]["decode_c1_tok_s"] * variants[fp8[0]]["weight_bytes"] / bandwidth}
           if fp8 else {}),
        "eager_reference_first_tokens": reference_tokens,
        "copy_bandwidth_gb_s": bandwidth / 1e9,
        "roofline_tok_s": roofline_tok_s,
        "roofline_fraction_c1": flare["decode_c1_tok_s"] / roofline_tok_s,
        "kv_bytes_mean": kv_bytes,
        "roofline_fraction_weights_kv": flare["decode_c1_tok_s"] * (weight_bytes + kv_bytes) / bandwidth,
        "hf_generate_c1_tok_s": hf_tok_s,
        "speedup_vs_hf": flare["decode_c1_tok_s"] / hf_tok_s,
        "shape": {"layers": args.layers, "hidden": args.hidden, "intermediate": args.intermediate,
                  "heads": "32/8", "head_dim": 128, "vocab": 151936, "dtype": "bfloat16"},
        "context": args.context, "steps": args.steps, "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__, **commit_and_date(),
    }
    report(result, args.out)


if __name__ == "__main__":
    main()
