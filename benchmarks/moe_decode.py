"""Mixture-of-experts decode, side by side in one process and one run: the routed experts through
Transformers' `grouped_mm` (the path before the fused op) and through `flare::routed_experts`
(flare_core.kernels.moe), against the active-weight roofline, at batch 1, 8 and 64.

Shapes (random bf16 weights drawn on the GPU under the recipe's prepared names):
  * qwen3-30b-a3b-12l: Qwen3-30B-A3B cut to 12 layers (hidden 2048, 128 experts top-8 of
    intermediate 768, 32/4 heads, vocab 151936; 8.1 B parameters), the MoE issue's model;
  * deepseek-v3-4l: DeepSeek-V3's layer shapes cut to 4 layers (1 dense + 3 MoE of 256 experts
    top-8 of intermediate 2048 and a shared expert; MLA; see benchmarks/decode_mla.py).

Each implementation gets its own model (built, measured, freed; the same seed draws the same
weights) served the way `flare run` serves it: compiled decoder layers, the one-token GEMV
kernel, captured decode graphs with greedy sampling inside, two steps in flight and each step's
tokens read back one step later. Per batch c: c requests prefilled with `--context` tokens, then
decoded together. The roofline of a step is the bytes of the weights it must read at the copy
bandwidth: every weight outside the routed experts, plus per MoE layer the experts its tokens
select (expected with random routing: E (1 - (1 - k/E)^c)). Also the time of one `--context`
token prompt through the model (eager prefill, as flare bench's TTFT includes). With --sweep, the
op alone at one token for several tile choices first (op_sweep).

    python benchmarks/moe_decode.py --shape qwen3-30b-a3b-12l --out benchmarks/results/moe-decode.json
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import torch

from decode_c1 import copy_bandwidth
from decode_mla import deepseek_v3_config, random_serving_model
from provenance import commit_and_date, report
from random_qwen3 import qwen3_moe_config

IMPLEMENTATIONS = ("grouped_mm", "flare")
PAGE_TOKENS = 64
WARMUP_STEPS = 8


def shape(name: str):
    """(config, recipe, MoE layers) of a named shape."""
    if name == "qwen3-30b-a3b-12l":
        from flare_recipe_qwen.recipes import QWEN3_MOE

        config = qwen3_moe_config(12)
        return config, QWEN3_MOE, config.num_hidden_layers
    if name == "deepseek-v3-4l":
        from flare_recipe_deepseek.recipes import DEEPSEEK_V3

        config = deepseek_v3_config(4)
        return config, DEEPSEEK_V3, config.num_hidden_layers - config.first_k_dense_replace
    if name == "kimi-linear":  # the published config (benchmarks/hybrid_decode.py); decode it there
        from hybrid_decode import shape as hybrid_shape

        config, recipe, moe_layers, _ = hybrid_shape(name)
        return config, recipe, moe_layers
    raise SystemExit(f"--shape: unknown {name!r}")


def expert_geometry(config) -> tuple[int, int, int]:
    """(routed experts, experts per token, bytes of one expert's matrices in bf16)."""
    experts = getattr(config, "num_experts", None) or config.n_routed_experts
    return experts, config.num_experts_per_tok, 3 * config.hidden_size * config.moe_intermediate_size * 2


def roofline_tok_s(config, moe_layers: int, weight_bytes: int, batch: int, bandwidth: float) -> tuple[float, int]:
    """(tok/s, bytes per step) if a step of `batch` tokens read only the weights it needs at
    `bandwidth`: not the routed experts no token chose, nor the embedding table (one row per token)
    unless it is also the head."""
    experts, top_k, expert_bytes = expert_geometry(config)
    embedding_bytes = 0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size * 2
    dense_bytes = weight_bytes - moe_layers * experts * expert_bytes - embedding_bytes
    used = experts * (1 - (1 - top_k / experts) ** batch)
    step_bytes = int(dense_bytes + moe_layers * used * expert_bytes)
    return batch * bandwidth / step_bytes, step_bytes


def decode(config, model, recipe, device, batches: list[int], context: int, steps: int,
           profile: Path | None = None, compile_model: bool = True) -> dict:
    from flare_core.executor.graphs import cuda_runner
    from flare_core.executor.sampling import StepSampling
    from flare_core.plugins import load_registry
    from flare_core.requests import SamplingParams
    from flare_core.scheduler import DecodeEntry, PrefillChunk, RequestHandle, StepPlan
    from flare_core.scheduler.estimates import StepKind

    scheme = load_registry().cache_schemes[recipe.cache_scheme].build(config, "bfloat16")
    total = context + 2 * WARMUP_STEPS + steps + 8
    per_request = -(-total // PAGE_TOKENS)
    rows = max(batches)
    started = time.perf_counter()
    executor = cuda_runner(model, scheme, num_pages=rows * per_request, page_tokens=PAGE_TOKENS, num_rows=rows,
                             num_snapshot_rows=0, num_logits_rows=0, vocab_size=config.vocab_size, device=device,
                             decode_capacities=tuple(sorted(set(batches))), context_length=total, compile_model=compile_model)
    results: dict = {"compile_and_capture_s": round(time.perf_counter() - started, 1)}
    generator = torch.Generator().manual_seed(0)
    seq = 0
    for batch in batches:
        handles = [RequestHandle(f"r{i}", i, 1) for i in range(batch)]
        pages = [tuple(range(i * per_request, (i + 1) * per_request)) for i in range(batch)]
        prefill_ms = []
        for handle, table in zip(handles, pages):
            prompt = tuple(torch.randint(1000, 100000, (context,), generator=generator).tolist())
            plan = StepPlan(seq, StepKind.PREFILL, context, (), (), (PrefillChunk(handle, 0, context, prompt, table,
                                                                                   True, None),), 0.0)
            seq += 1
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            executor.record_sampled([handle.state_row], executor.run(plan).argmax(-1))
            torch.cuda.synchronize()
            prefill_ms.append(1000 * (time.perf_counter() - t0))
        greedy = StepSampling([SamplingParams(temperature=0.0)] * batch, [0] * batch, [None] * batch)

        def launch(position: int):
            nonlocal seq
            entries = tuple(DecodeEntry(h, position, None, table) for h, table in zip(handles, pages))
            plan = StepPlan(seq, StepKind.DECODE, batch, (), entries, (), 0.0)
            seq += 1
            host = executor.step(plan, greedy).token_ids.to("cpu", non_blocking=True)
            done = torch.cuda.Event()
            done.record()
            return host, done

        def run(first: int, count: int) -> None:
            pending = launch(first)
            for i in range(1, count):  # two steps in flight: issue the next, then read the one before
                following = launch(first + i)
                pending[1].synchronize()
                pending[0].tolist()
                pending = following
            pending[1].synchronize()

        run(context, WARMUP_STEPS)
        torch.cuda.synchronize()
        start = time.perf_counter()
        run(context + WARMUP_STEPS, steps)
        seconds = time.perf_counter() - start
        if profile is not None and batch == batches[0]:  # where a step's device time goes, by kernel
            from torch.profiler import ProfilerActivity, profile as torch_profile

            with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                run(context + WARMUP_STEPS + steps, 20)
            profile.write_text(prof.key_averages().table(sort_by="cuda_time_total", row_limit=60,
                                                         max_name_column_width=90))
        results[str(batch)] = {"decode_tok_s": round(batch * steps / seconds, 1),
                               "ms_per_step": round(1000 * seconds / steps, 3),
                               "prefill_ms_median": round(sorted(prefill_ms)[len(prefill_ms) // 2], 2)}
    replays = {capacity: g.replays for capacity, g in executor.graphs.decode_graphs.items()}
    if not all(replays.values()):
        raise RuntimeError(f"decode steps did not all replay graphs: {replays}")
    return results


def graph_us(step, repeats: int) -> float:
    """Microseconds per replay of `step` captured as one CUDA graph (compiled outside the capture)."""
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    end.synchronize()
    return 1000 * start.elapsed_time(end) / repeats


def op_sweep(config, moe_layers: int, device, repeats: int = 50) -> dict:
    """The op's two launches alone at one token, each over a grid of tiles:
    microseconds per MoE layer and the bandwidth of reading the chosen experts' rows, over up to
    8 layers of distinct weights replayed as one CUDA graph (as a decode step holds them; each
    layer's chosen experts exceed the L2 cache), each layer with its own random route. Beside
    them, the GEMV kernel over one matrix of the same bytes (the bound a launch of these bytes
    reaches), and for families with a shared expert of a routed expert's shape the shared
    expert's two GEMVs against routing it as one more pair of the op."""
    from flare_core.kernels import moe
    from flare_core.kernels.gemv import gemv, gemv_config

    experts, top_k, expert_bytes = expert_geometry(config)
    hidden, intermediate = config.hidden_size, config.moe_intermediate_size
    layers_timed = min(moe_layers, 8)
    generator = torch.Generator(device=device).manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device=device, generator=generator).bfloat16()

    # One expert more than the family routes: the shared expert's place when it is routed as a pair.
    layers = [(randn(experts + 1, 2 * intermediate, hidden), randn(experts + 1, hidden, intermediate))
              for _ in range(layers_timed)]
    x = randn(1, hidden)
    routes = [torch.randn(1, experts, device=device, generator=generator).softmax(-1).topk(top_k)
              for _ in layers]
    routes = [(weights.reshape(-1).contiguous(), index.reshape(-1).contiguous()) for weights, index in routes]
    activated = [x.new_empty(top_k + 1, intermediate) for _ in layers]
    weighted = [torch.empty(top_k + 1, hidden, dtype=torch.float32, device=device) for _ in layers]
    gate_up_bytes, down_bytes = top_k * expert_bytes * 2 // 3, top_k * expert_bytes // 3

    def launches(gated: bool, tiles: moe.ExpertsConfig, pairs: int = top_k):
        def step():
            for i, (gate_up, down) in enumerate(layers):
                weights, index = routes[i]
                if pairs > top_k:  # the shared expert (index `experts`) as one more pair of weight 1
                    index = torch.cat([index, index.new_full((1,), experts)])
                    weights = torch.cat([weights, weights.new_ones(1)])
                moe._launch(x if gated else activated[i][:pairs], gate_up if gated else down, None,
                            activated[i] if gated else weighted[i], weights, index, None, pairs, gated, tiles)
        return step

    results: dict = {"gate_up": {}, "down": {}}
    for gated, name, nbytes in ((True, "gate_up", gate_up_bytes), (False, "down", down_bytes)):
        # Pair by pair (the one-token path): rows x columns per iteration x warps.
        grid = [moe.ExpertsConfig(1, n, k, w, 1) for n in (4, 8, 16, 32) for k in (128, 256, 512) for w in (2, 4, 8)]
        for tiles in [moe.experts_config(top_k, experts, gated), *grid]:
            key = f"n{tiles.block_n} k{tiles.block_k} w{tiles.warps}"
            if key in results[name]:
                continue
            us = graph_us(launches(gated, tiles), repeats) / layers_timed
            results[name][key] = {"us_per_layer": round(us, 2), "gb_s": round(nbytes / us / 1e3, 1)}
            print(f"op sweep {name} {key}: {results[name][key]}", flush=True)
        results[name] = dict(sorted(results[name].items(), key=lambda item: item[1]["us_per_layer"]))
    # The same bytes as one matrix through the GEMV kernel: gate/up gated, down plain.
    for gated, name, rows, features in ((True, "gate_up", 2 * top_k * intermediate, hidden),
                                        (False, "down", top_k * hidden, intermediate)):
        matrices = [randn(rows, features) for _ in layers]
        vector = randn(features)
        tiles = gemv_config(rows // 2 if gated else rows, features, gated)
        us = graph_us(lambda: [gemv(vector, m, tiles, gated=gated) for m in matrices], repeats) / layers_timed
        results[f"{name}_as_one_gemv"] = {"us_per_layer": round(us, 2),
                                          "gb_s": round(rows * features * 2 / us / 1e3, 1), "tiles": str(tiles)}
        print(f"op sweep {name} as one GEMV: {results[f'{name}_as_one_gemv']}", flush=True)
        del matrices
    shared = getattr(config, "n_shared_experts", None) or getattr(config, "num_shared_experts", 0)
    if shared == 1:
        up_tiles, down_tiles = moe.experts_config(top_k, experts, True), moe.experts_config(top_k, experts, False)
        shared_up = [randn(2 * intermediate, hidden) for _ in layers]
        shared_down = [randn(hidden, intermediate) for _ in layers]
        up_config, down_config = gemv_config(intermediate, hidden, True), gemv_config(hidden, intermediate)

        def routed_then_shared():
            launches(True, up_tiles)()
            launches(False, down_tiles)()
            for up, down in zip(shared_up, shared_down):
                gemv(gemv(x[0], up, up_config, gated=True), down, down_config)

        def shared_as_pair():
            launches(True, up_tiles, top_k + 1)()
            launches(False, down_tiles, top_k + 1)()

        results["shared_expert"] = {
            "routed then shared GEMVs": round(graph_us(routed_then_shared, repeats) / layers_timed, 2),
            "routed only": round(graph_us(lambda: (launches(True, up_tiles)(), launches(False, down_tiles)()),
                                          repeats) / layers_timed, 2),
            "shared as one more pair": round(graph_us(shared_as_pair, repeats) / layers_timed, 2)}
        print(f"op sweep shared expert (us per layer): {results['shared_expert']}", flush=True)
    layers.clear()
    torch.cuda.empty_cache()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3-30b-a3b-12l", choices=("qwen3-30b-a3b-12l", "deepseek-v3-4l", "kimi-linear"))
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--context", type=int, default=1024, help="prompt tokens per request")
    parser.add_argument("--steps", type=int, default=128, help="timed decode steps per batch")
    parser.add_argument("--sweep", action="store_true", help="first time the op alone at one token per tile choice")
    parser.add_argument("--implementations", nargs="*", choices=IMPLEMENTATIONS, default=list(IMPLEMENTATIONS),
                        help="the decode runs (none: --sweep alone)")
    parser.add_argument("--profile", type=Path,
                        help="write a per-kernel table of 20 decode steps of the fused path at the first batch here")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    device = torch.device("cuda")
    bandwidth = copy_bandwidth(device)
    config, recipe, moe_layers = shape(args.shape)
    sweep = op_sweep(config, moe_layers, device) if args.sweep else None
    runs, weight_bytes = {}, 0
    for implementation in args.implementations:
        model = random_serving_model(config, device, recipe)
        model.model.set_experts_implementation(implementation)
        weight_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        runs[implementation] = decode(config, model, recipe, device, args.batch, args.context, args.steps,
                                      args.profile if implementation == "flare" else None)
        # Compiled code keeps the model's tensors alive until dynamo forgets it: two 74 GB models
        # (deepseek-v3-4l) do not fit the GPU together.
        del model
        torch._dynamo.reset()
        gc.collect()
        torch.cuda.empty_cache()
        print(implementation, json.dumps(runs[implementation]), flush=True)
    roofline = {}
    for batch in args.batch if runs else ():
        tok_s, step_bytes = roofline_tok_s(config, moe_layers, weight_bytes, batch, bandwidth)
        roofline[str(batch)] = {"tok_s": round(tok_s, 1), "bytes_per_step": step_bytes,
                                **{f"fraction_{impl}": round(runs[impl][str(batch)]["decode_tok_s"] / tok_s, 3)
                                   for impl in args.implementations}}
    result = {"benchmark": "moe_decode", "shape": args.shape, "weight_bytes": weight_bytes,
              "copy_bandwidth_gb_s": round(bandwidth / 1e9, 1), "implementations": runs, "roofline": roofline,
              "op_sweep": sweep,
              "context": args.context, "steps": args.steps, "device": torch.cuda.get_device_name(device),
              "torch": torch.__version__, **commit_and_date()}
    report(result, args.out)


if __name__ == "__main__":
    main()
