"""Decode microbenchmark of a DeepSeek-V3-shaped model: absorbed MLA through FlashInfer and MoE
layers, replayed as captured decode graphs by the CUDA executor (flare_core.executor.graphs).

Random bf16 weights of DeepSeek-V3's real layer shapes -- hidden 7168; MLA with 128 heads,
q_lora_rank 1536, kv_lora_rank 512, nope 128, rope 64, v 128 (YaRN); 256 routed experts of
intermediate 2048, 8 active, 1 shared, n_group 8 / topk_group 4; a dense first layer of
intermediate 18432; vocab 129280 -- but only `--layers` decoder layers (default 4: 1 dense +
3 MoE, about 74 GB) so that it fits one H200. The tensors are drawn directly on the GPU under
the prepared names, shapes and dtypes of the recipe's serving model (those `map_weights` yields):
drawing 256 experts per layer through a Transformers model on the CPU would take minutes.
Matrices ~ N(0, 0.02), norm weights 1, router bias 0, so routing is random: at concurrency 32
a MoE layer reads about 160 of its 256 experts per step.

For each concurrency c (`--concurrency 1 32`): c requests are prefilled with `--context` random
tokens each, then decoded greedily together through the capacity-c decode graph, the sampled
tokens read back every step (as serving does). Decode tok/s = steps per second x c.

    python benchmarks/decode_mla.py --out benchmarks/results/decode-mla.json
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from provenance import commit_and_date, report
from random_qwen3 import draw

# DeepSeek-V3's config.json rope scaling.
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
        "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0}
PAGE_TOKENS = 64
WARMUP_STEPS = 5


def deepseek_v3_config(layers: int):
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=layers, num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256,
        n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4, first_k_dense_replace=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, max_position_embeddings=163840, rope_parameters=YARN,
        tie_word_embeddings=False, num_nextn_predict_layers=0)


def random_serving_model(config, device: torch.device, recipe=None) -> torch.nn.Module:
    """`recipe`'s serving model (default DeepSeek-V3's) with random weights drawn on `device`, built
    as `flare run` builds it on CUDA (one-token matmuls on the GEMV kernel)."""
    from flare_core.ops.loading import load_prepared_weights
    from flare_core.ops.serving import ServingOptions, serving_model
    from flare_recipe_deepseek.recipes import DEEPSEEK_V3

    # On the meta device: names, shapes, dtypes.
    model = serving_model(recipe or DEEPSEEK_V3, config, torch.bfloat16, ServingOptions(gemv=True))
    generator = torch.Generator(device=device).manual_seed(0)
    tensors = {name: draw(name, torch.empty(meta.shape, dtype=meta.dtype, device=device), generator)
               for name, meta in model.state_dict().items()}
    return load_prepared_weights(model, tensors, device)


def flare_decode(config, model, device, concurrency: list[int], context: int, steps: int) -> dict:
    from flare_core.executor.graphs import cuda_runner
    from flare_core.plugins import load_registry
    from flare_core.scheduler import DecodeEntry, PrefillChunk, RequestHandle, StepPlan
    from flare_core.scheduler.estimates import StepKind
    from flare_recipe_deepseek.recipes import DEEPSEEK_V3

    scheme = load_registry().cache_schemes[DEEPSEEK_V3.cache_scheme].build(config, "bfloat16")
    total = context + WARMUP_STEPS + steps + 1
    pages_per_request = -(-total // PAGE_TOKENS)
    rows = max(concurrency)
    started = time.perf_counter()
    executor = cuda_runner(model, scheme, num_pages=rows * pages_per_request, page_tokens=PAGE_TOKENS,
                             num_rows=rows, num_snapshot_rows=0, num_logits_rows=0, vocab_size=config.vocab_size,
                             device=device, decode_capacities=tuple(sorted(set(concurrency))), context_length=total)
    results = {"graph_capture_s": time.perf_counter() - started}
    generator = torch.Generator().manual_seed(0)
    seq = 0
    for c in concurrency:
        handles = [RequestHandle(f"r{i}", i, 1) for i in range(c)]
        pages = [tuple(range(i * pages_per_request, (i + 1) * pages_per_request)) for i in range(c)]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        tokens = []
        for handle, table in zip(handles, pages):
            prompt = tuple(torch.randint(1000, 100000, (context,), generator=generator).tolist())
            chunk = PrefillChunk(handle, 0, context, prompt, table, True, None)
            plan = StepPlan(seq, StepKind.PREFILL, context, (), (), (chunk,), 0.0)
            tokens.append(int(executor.run(plan).argmax(-1).item()))
            seq += 1
        prefill_s = time.perf_counter() - t0

        def decode(position: int, tokens: list[int]) -> list[int]:
            nonlocal seq
            entries = tuple(DecodeEntry(h, position, t, table) for h, t, table in zip(handles, tokens, pages))
            plan = StepPlan(seq, StepKind.DECODE, c, (), entries, (), 0.0)
            seq += 1
            return executor.run(plan).argmax(-1).tolist()  # the host reads the tokens back every step

        for i in range(WARMUP_STEPS):
            tokens = decode(context + i, tokens)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for i in range(steps):
            tokens = decode(context + WARMUP_STEPS + i, tokens)
        seconds = time.perf_counter() - start
        results[str(c)] = {"decode_tok_s": c * steps / seconds, "ms_per_step": 1000 * seconds / steps,
                           "prefill_s": prefill_s}
        print(f"concurrency {c:3d}: {c * steps / seconds:9.1f} tok/s, {1000 * seconds / steps:7.2f} ms/step "
              f"(prefill of {c} x {context} tokens: {prefill_s:.2f} s)", flush=True)
    replays = {capacity: g.replays for capacity, g in executor.graphs.decode_graphs.items()}
    if not all(replays.values()):
        raise RuntimeError(f"decode steps did not all replay graphs: {replays}")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4, help="decoder layers: the first dense, the rest MoE")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--context", type=int, default=1024, help="prompt tokens per request")
    parser.add_argument("--steps", type=int, default=256, help="timed decode steps per concurrency")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    device = torch.device("cuda")
    config = deepseek_v3_config(args.layers)
    started = time.perf_counter()
    model = random_serving_model(config, device)
    init_s = time.perf_counter() - started
    weight_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    flare = flare_decode(config, model, device, args.concurrency, args.context, args.steps)
    try:
        import flashinfer

        flashinfer_version = flashinfer.__version__
    except ImportError:
        flashinfer_version = None
    result = {
        "benchmark": "decode_mla",
        "concurrency": {str(c): flare[str(c)] for c in args.concurrency},
        "graph_capture_s": flare["graph_capture_s"],
        "weight_init_s": init_s,
        "weight_bytes": weight_bytes,
        "shape": {"model": "DeepSeek-V3 layer shapes", "layers": args.layers, "dense_layers": 1,
                  "hidden": config.hidden_size, "heads": config.num_attention_heads, "q_lora_rank": config.q_lora_rank,
                  "kv_lora_rank": config.kv_lora_rank, "qk_nope_head_dim": config.qk_nope_head_dim,
                  "qk_rope_head_dim": config.qk_rope_head_dim, "v_head_dim": config.v_head_dim,
                  "dense_intermediate": config.intermediate_size, "routed_experts": config.n_routed_experts,
                  "active_experts": config.num_experts_per_tok, "shared_experts": config.n_shared_experts,
                  "moe_intermediate": config.moe_intermediate_size, "n_group": config.n_group,
                  "topk_group": config.topk_group, "vocab": config.vocab_size, "dtype": "bfloat16",
                  "page_tokens": PAGE_TOKENS},
        "context": args.context, "steps": args.steps, "warmup_steps": WARMUP_STEPS, "sampling": "greedy",
        "device": torch.cuda.get_device_name(device), "torch": torch.__version__, "flashinfer": flashinfer_version,
        **commit_and_date(),
    }
    report(result, args.out)


if __name__ == "__main__":
    main()
