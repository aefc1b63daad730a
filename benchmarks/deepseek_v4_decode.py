"""DeepSeek V4 decode on the CUDA runner at V4 Flash's per-layer shapes (#48's targets).

Transformers' `DeepseekV4Config()` defaults are V4 Flash's shapes (hidden 4096, 64 heads of 512,
256 routed experts of 2048, top-6, CSA rate 4 with an indexer keeping 512, HCA rate 128, a
128-token window, 4 mHC streams); the depth is cut to `--layers` (default 4: HCA with hash
routing, CSA, HCA, CSA: every layer kind and the real expert count), random weights, the routed
experts packed FP4 as published (`flare export --quantize fp8` keeps them so; flare_core.ops.fp4).
The context is not prefilled: a request's pages are simply held (its stores read as they are),
so a step at a 131,072-token context costs what it would after a real prompt.

For each `--contexts` length, `--steps` decode steps of `--rows` requests are replayed from the
decode graph (two in flight, each input token read on the device from the step before, as
serving does) and timed. Reported per context: ms per step, and the bytes a step must read
(weights the step uses: everything but the routed experts and the embedding table, plus the
experts its rows chose,
top-k per row and MoE layer, at their stored size; the caches: window rings, CSA's indexer keys in full and its top-k
entries, HCA's records) against the device's copy bandwidth; the 131,072 / 4,096 step ratio.

    python3 benchmarks/deepseek_v4_decode.py --fp8 --out benchmarks/results/h200-deepseek-v4.json
    python3 benchmarks/deepseek_v4_decode.py --tiny --device cpu      # a smoke run of the script
    python3 benchmarks/deepseek_v4_decode.py --experts-sweep ...      # the FP4 experts' tiles first
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from provenance import commit_and_date, report

HCA, CSA = "heavily_compressed_attention", "compressed_sparse_attention"


def v4_config(layers: int, tiny: bool):
    """V4 Flash's shapes at `layers` layers (alternating HCA and CSA, hash routing in the first),
    or flare_testing's tiny V4 with `tiny`."""
    from transformers import DeepseekV4Config

    if tiny:
        from flare_testing.deepseek import tiny_v4_config

        return tiny_v4_config()
    kinds = [HCA if i % 2 == 0 else CSA for i in range(layers)]
    return DeepseekV4Config(num_hidden_layers=layers, layer_types=kinds,
                            mlp_layer_types=["hash_moe"] + ["moe"] * (layers - 1))


def random_model(config, device: torch.device, fp8: bool = False, recipe=None,
                 embedding: str = "model.embed_tokens.weight", tables: dict | None = None):
    """The served model of `recipe` (V4's unless given) with random weights, its routed experts FP4
    (random codes, scales of 2^-8 .. 2^-5), with `fp8` its decoder layers' linear weights (and packed
    shared experts) FP8 blocks as DeepSeek publishes them (random values, scales of 2^-8), on
    `device`, its embedding tables (flare_core.ops.tables) read from `tables` where they are; returns
    (model, routed-expert bytes, bytes of the `embedding` table, all weight bytes)."""
    from flare_core.kernels.fp4 import SCALE_SUFFIX
    from flare_core.kernels.fp8 import SCALE_SUFFIX as FP8_SCALE_SUFFIX
    from flare_core.ops.fp8 import quantizable_experts, quantizable_linears
    from flare_core.ops.loading import load_prepared_weights
    from flare_core.ops.serving import ServingOptions, serving_model
    from flare_recipe_deepseek.v4_recipe import DEEPSEEK_V4

    recipe = recipe or DEEPSEEK_V4
    skeleton = recipe.build_model(config, torch.bfloat16)
    packed = [f"{path}.{leaf}" for path in quantizable_experts(skeleton) for leaf in ("gate_up_proj", "down_proj")]
    experts = tuple(name for name in packed if ".shared_experts." not in name)
    shared = tuple(name for name in packed if ".shared_experts." in name) if fp8 else ()
    linears = tuple(quantizable_linears(skeleton)) if fp8 else ()
    model = serving_model(recipe, config, torch.bfloat16,
                          ServingOptions(gemv=device.type == "cuda", fp4_experts=experts, fp8_linears=linears,
                                         fp8_experts=shared))
    generator = torch.Generator(device=device).manual_seed(0)
    prepared = {}
    for name, target in model.state_dict().items():
        if target.dtype == torch.uint8:
            prepared[name] = torch.randint(0, 256, target.shape, dtype=torch.uint8, device=device, generator=generator)
        elif name.endswith(SCALE_SUFFIX):
            exponents = torch.randint(-8, -4, target.shape, device=device, generator=generator)
            prepared[name] = torch.exp2(exponents.float()).to(target.dtype)
        elif name.endswith(FP8_SCALE_SUFFIX):
            prepared[name] = torch.full(target.shape, 2.0 ** -8, dtype=target.dtype, device=device)
        elif target.dtype == torch.float8_e4m3fn:
            prepared[name] = torch.randn(target.shape, device=device, generator=generator).to(target.dtype)
        elif name.endswith("tid2eid"):
            prepared[name] = torch.randint(0, config.n_routed_experts, target.shape, device=device,
                                           generator=generator).to(target.dtype)
        elif target.is_floating_point():
            prepared[name] = (torch.randn(target.shape, device=device, generator=generator) * 0.02).to(target.dtype)
        else:
            prepared[name] = torch.zeros(target.shape, dtype=target.dtype, device=device)
    sizes = {name: t.numel() * t.element_size() for name, t in prepared.items()}
    routed = sum(size for name, size in sizes.items() if any(name.startswith(e) for e in experts))
    # The embedding table: a step reads a row per token, not the table (the head, untied, is read whole).
    return (load_prepared_weights(model, {**prepared, **(tables or {})}, device), routed, sizes[embedding],
            sum(sizes.values()))


def step_cache_bytes(config, context: int) -> int:
    """What one decode step reads of the caches at `context` tokens, per request, bf16."""
    total = 0
    for kind in config.layer_types:
        total += config.sliding_window * config.head_dim * 2
        if kind == CSA:
            records = context // config.compress_rates[CSA]
            total += records * config.index_head_dim * 2 + min(records, config.index_topk) * config.head_dim * 2
        elif kind == HCA:
            total += context // config.compress_rates[HCA] * config.head_dim * 2
    return total


def decode_times(model, config, device: torch.device, contexts: list[int], steps: int, rows: int,
                 compile_model: bool, profile: Path | None = None, scheme=None) -> dict[int, float]:
    """Seconds per decode step at each context (see the module docstring) over the cache `scheme`
    (V4's unless given); with `profile`, a table of where 20 steps at the longest context spend
    their time, by kernel, written there."""
    from flare_core.executor.sampling import StepSampling
    from flare_core.requests import SamplingParams
    from flare_core.scheduler import DecodeEntry, RequestHandle, StepPlan
    from flare_core.scheduler.estimates import StepKind
    from flare_recipe_deepseek.v4 import compressed_attention_scheme

    scheme = scheme or compressed_attention_scheme(config, "bfloat16")
    page_tokens = 128
    longest = max(contexts) + steps + 16
    per_request = -(-longest // page_tokens)
    common = dict(num_pages=rows * per_request, page_tokens=page_tokens, num_rows=rows, num_snapshot_rows=0,
                  num_logits_rows=0, vocab_size=config.vocab_size, device=device)
    if device.type == "cuda":
        from flare_core.executor.graphs import cuda_runner

        executor = cuda_runner(model, scheme, **common, decode_capacities=(rows,), context_length=longest,
                               compile_model=compile_model)
    else:
        from flare_core.executor.runner import eager_runner

        executor = eager_runner(model, scheme, **common)
    handles = [RequestHandle(f"r{r}", r, 1) for r in range(rows)]
    pages = [tuple(range(r * per_request, (r + 1) * per_request)) for r in range(rows)]
    greedy = StepSampling([SamplingParams(temperature=0.0)] * rows, [0] * rows, [None] * rows)

    def launch(position: int, first: bool):
        entries = tuple(DecodeEntry(h, position, 5 if first else None, p) for h, p in zip(handles, pages))
        output = executor.step(StepPlan(position, StepKind.DECODE, rows, (), entries, (), 0.0), greedy)
        done = torch.cuda.Event() if device.type == "cuda" else None
        if done is not None:
            done.record()
        return done

    def run(position: int, count: int) -> float:
        wait = lambda event: event.synchronize() if event is not None else None  # noqa: E731
        pending = launch(position, True)
        start = time.perf_counter()
        for i in range(1, count):
            following = launch(position + i, False)
            wait(pending)
            pending = following
        wait(pending)
        return (time.perf_counter() - start) / max(count - 1, 1)

    def replays() -> dict[int, int]:
        """Replays so far of the decode graphs by page-table width (graphs.decode_widths)."""
        graphs = getattr(executor, "graphs", None)
        return {} if graphs is None else \
            {g.width: g.replays for top in graphs.decode_graphs.values() for g in (top, *top.narrower)}

    times = {}
    for context in contexts:
        run(context, 4)  # warm-up replays
        before = replays()
        times[context] = run(context + 4, steps)
        widths = sorted(width for width, count in replays().items() if count > before.get(width, 0))
        if widths:  # the CUDA runner: which page-table width the steps at this context replayed
            print(f"context {context}: replayed the decode graphs of {widths} pages a row (of "
                  f"{sorted(replays())})", flush=True)
    if profile is not None:
        from torch.profiler import ProfilerActivity, profile as torch_profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with torch_profile(activities=activities) as prof:
            run(max(contexts) + 4 + steps, 20)
        key = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
        profile.write_text(prof.key_averages().table(sort_by=key, row_limit=40, max_name_column_width=90))
    return times


def experts_sweep(config, device: torch.device, layers: int = 4, repeats: int = 50) -> dict:
    """The FP4 experts op's two launches alone at one token (V4 Flash's experts: 256, top-6, packed
    FP4 as published), over a grid of tiles, each over `layers` layers of distinct weights and
    routes replayed as one CUDA graph (as moe_decode.py's op_sweep times 16-bit experts):
    microseconds per layer and the bandwidth of the chosen experts' bytes (codes and scales).
    The first entry of each is the tiles `experts_config` picks; each tile with the codes decoded
    each way of ExpertsConfig.fp4_decode (value by value unnamed, " groups", " fp8")."""
    from flare_core.kernels import moe
    from moe_decode import graph_us

    experts, top_k = config.n_routed_experts, config.num_experts_per_tok
    hidden, inter = config.hidden_size, config.moe_intermediate_size
    generator = torch.Generator(device=device).manual_seed(0)

    def packed(rows: int, cols: int):
        codes = torch.randint(0, 256, (experts, rows, cols // 2), dtype=torch.uint8, device=device, generator=generator)
        exponents = torch.randint(-8, -4, (experts, rows, cols // 32), device=device, generator=generator)
        return codes, torch.exp2(exponents.float()).to(torch.float8_e8m0fnu)

    weights = [(packed(2 * inter, hidden), packed(hidden, inter)) for _ in range(layers)]
    routes = [torch.randperm(experts, device=device, generator=generator)[:top_k] for _ in range(layers)]
    x = torch.randn(1, hidden, device=device, generator=generator).bfloat16()
    route_weights = torch.rand(top_k, device=device, generator=generator)
    activated = x.new_empty(top_k, inter)
    weighted = torch.empty(top_k, hidden, dtype=torch.float32, device=device)
    results: dict = {}
    for gated, name in ((True, "gate_up"), (False, "down")):
        rows, cols = (2 * inter, hidden) if gated else (hidden, inter)
        chosen_bytes = top_k * rows * (cols // 2 + cols // 32)
        grid = [moe.ExpertsConfig(1, n, k, w, 1, decode) for decode in moe.FP4_DECODES for n in (4, 8, 16)
                for k in (128, 256, 512) for w in (4, 8)]
        results[name] = {}
        for tiles in [moe.experts_config(top_k, experts, gated, torch.uint8), *grid]:
            decode = "" if tiles.fp4_decode == "values" else " " + tiles.fp4_decode
            key = f"n{tiles.block_n} k{tiles.block_k} w{tiles.warps}{decode}"
            if key in results[name]:
                continue

            def step(tiles=tiles):
                for ((gate_up, gate_up_scale), (down, down_scale)), ids in zip(weights, routes):
                    moe._launch(x if gated else activated, gate_up if gated else down,
                                gate_up_scale if gated else down_scale, activated if gated else weighted,
                                route_weights, ids, None, top_k, gated, tiles, config.swiglu_limit if gated else 0.0)

            us = graph_us(step, repeats) / layers
            results[name][key] = {"us_per_layer": round(us, 2), "gb_s": round(chosen_bytes / us / 1e3, 1)}
            print(f"experts sweep {name} {key}: {results[name][key]}", flush=True)
    return results


def decode_arguments(description: str) -> argparse.ArgumentParser:
    """The arguments the DeepSeek decode benchmarks share (each adds its own `--tiny` and `--fp8`)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--contexts", default="4096,131072")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--profile", type=Path, help="write a per-kernel table of 20 steps at the longest context here")
    parser.add_argument("--no-compile", action="store_true", help="the decode graphs replay the layers uncompiled")
    return parser


def active_weight_bytes(config, rows: int, weight_bytes: int, embedding_bytes: int, routed_bytes: int) -> int:
    """The weight bytes a decode step of `rows` rows reads: everything but the embedding table and
    the routed experts, and of these each MoE layer's experts the rows chose (top-k a row, at most
    all of them)."""
    chosen = min(rows * config.num_experts_per_tok, config.n_routed_experts)
    return weight_bytes - embedding_bytes - routed_bytes + routed_bytes * chosen // config.n_routed_experts


def decode_figures(times: dict[int, float], active: int, rows: int, cache_bytes, device: torch.device) -> dict:
    """The results' figures from the seconds per step at each context: the device's copy bandwidth,
    per context the ms per step, the bytes it reads (`active` weights plus `cache_bytes(context)`
    per row) and their fraction of the roofline, the first context's fraction at one row, and the
    longest context's step over the shortest's."""
    bandwidth = None
    if device.type == "cuda":
        sys.path.insert(0, str(Path(__file__).parent))
        from decode_c1 import copy_bandwidth

        bandwidth = copy_bandwidth(device)
    per_context = {}
    for context, seconds in times.items():
        step_bytes = active + rows * cache_bytes(context)
        per_context[str(context)] = {
            "step_ms": 1000 * seconds, "step_bytes": step_bytes,
            "roofline_fraction": step_bytes / seconds / bandwidth if bandwidth else None}
    first, last = min(times), max(times)
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "copy_bandwidth_bytes_s": bandwidth, "contexts": per_context,
            "roofline_fraction_c1": per_context[str(first)]["roofline_fraction"] if rows == 1 else None,
            "step_128k_over_4k": times[last] / times[first] if len(times) > 1 else None,
            "target_roofline_fraction_c1": 0.45, "target_step_128k_over_4k": 1.5}


def main() -> None:
    parser = decode_arguments(__doc__)
    parser.add_argument("--tiny", action="store_true", help="flare_testing's tiny V4 (a smoke run of the script)")
    parser.add_argument("--fp8", action="store_true",
                        help="the decoder layers' linear weights as FP8 blocks, as V4 Flash publishes them")
    parser.add_argument("--experts-sweep", action="store_true",
                        help="first time the FP4 experts op alone at one token per tile choice (experts_sweep)")
    args = parser.parse_args()
    device = torch.device(args.device)
    config = v4_config(args.layers, args.tiny)
    contexts = [int(c) for c in args.contexts.split(",")]
    if args.experts_sweep:
        sys.path.insert(0, str(Path(__file__).parent))
        sweep = experts_sweep(config, device)
    model, routed_bytes, embedding_bytes, weight_bytes = random_model(config, device, args.fp8)
    active = active_weight_bytes(config, args.rows, weight_bytes, embedding_bytes, routed_bytes)
    times = decode_times(model, config, device, contexts, args.steps, args.rows, not args.no_compile, args.profile)
    result = {**commit_and_date(), "command": "python3 " + " ".join(sys.argv),
              "layers": config.num_hidden_layers, "layer_types": list(config.layer_types), "rows": args.rows,
              "linear_weights": "fp8 blocks" if args.fp8 else "bfloat16",
              "weight_bytes": weight_bytes, "routed_expert_bytes_fp4": routed_bytes,
              "active_weight_bytes_per_step": active,
              **decode_figures(times, active, args.rows, lambda context: step_cache_bytes(config, context), device),
              "experts_sweep": sweep if args.experts_sweep else None}
    report(result, args.out)


if __name__ == "__main__":
    main()
