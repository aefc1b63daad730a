"""Delta-rule hybrids on the GPU: decode against the bandwidth roofline, and the first token of a
prompt whose 4k-token prefix a state snapshot restores against the same prompt cold.

Shapes (`--shape`; random bf16 weights drawn on the GPU under the serving model's prepared names):

* `qwen3.5`: Qwen3.5's default dense text shape (Transformers' `Qwen3_5TextConfig()`: hidden
  4096, 32 layers of which 24 Gated DeltaNet and 8 gated full attention, 16 / 4 heads of 256,
  linear heads 16 key / 32 value of 128, vocab 248320);
* `kimi-linear`: Kimi Linear 48B-A3B as published (recipes-kimi/tests/fixtures/kimi-linear/
  config.json read by `KimiLinearConfig`: hidden 2304, 27 layers of which 20 KDA and 7 MLA, 26
  MoE layers of 256 experts top-8 with a shared expert), served by recipe kimi-linear.

Decode is served the way `flare run` serves it (benchmarks/moe_decode.py's `decode`: compiled
decoder layers, the one-token GEMV kernel, captured decode graphs with greedy sampling inside,
two steps in flight). The roofline of a step is its bytes at the copy bandwidth: every weight but
the (untied) embedding table, plus per request its state rows read and written (convolution
windows and recurrent matrices of the linear layers) and its K/V pages read at the context; of a
MoE model's routed experts only those a step's tokens can choose (benchmarks/moe_decode.py's
`roofline_tok_s`).

First token (`--prefix-tokens` shared, `--suffix-tokens` new): a scheduler with a prefix cache
that snapshots continuation state, over the CUDA executor, `--chunk` token prompt chunks; the
time from submitting a request to its first sampled token (no HTTP, no tokenizer). Cold: a fresh
prompt; warm: a prompt that shares the cold one's first `--prefix-tokens` (a message boundary),
so its state and pages are restored and only the suffix is computed.

    python benchmarks/hybrid_decode.py --out benchmarks/results/h200-qwen3.5-decode.json
    python benchmarks/hybrid_decode.py --shape kimi-linear --batch 1 8 --out benchmarks/results/h200-kimi-linear-decode.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from decode_c1 import copy_bandwidth
from decode_mla import random_serving_model
from moe_decode import decode, roofline_tok_s
from provenance import commit_and_date, report

PAGE_TOKENS = 64
# The published Kimi Linear config (its SOURCES.md says which fields and from where).
KIMI_LINEAR_CONFIG = Path(__file__).parents[1] / "recipes-kimi/tests/fixtures/kimi-linear/config.json"


def first_token(config, model, recipe, device, prefix: int, suffix: int, chunk: int,
                profile: Path | None = None, compile_model: bool = True) -> dict:
    """Seconds to the first token of a cold prompt and of one restoring its prefix's snapshot
    (with `profile`, a second restoring prompt under the profiler: its kernels and host time)."""
    from flare_core.kv import KvCacheManager, PageAllocator, PrefixCache
    from flare_core.contract import Capacities
    from flare_core.executor.graphs import cuda_runner
    from flare_core.plugins import load_registry
    from flare_core.scheduler import GraphCapacities, Scheduler, SchedulerConfig, StepResult

    scheme = load_registry().cache_schemes[recipe.cache_scheme].build(config, "bfloat16")
    rows, snapshots, total = 2, 8, prefix + suffix + 8
    num_pages = 4 * -(-total // PAGE_TOKENS)
    capacities = Capacities(max_concurrency=rows, prefill_chunk_size=chunk, context_length=2 * total)
    catalog = GraphCapacities.from_specs(capacities.graph_catalog())
    # As `flare run` builds it (flare_core.engine.build): prefill graphs of the catalog's capacities.
    executor = cuda_runner(model, scheme, num_pages=num_pages, page_tokens=PAGE_TOKENS, num_rows=rows,
                             num_snapshot_rows=snapshots, num_logits_rows=8, vocab_size=config.vocab_size,
                             device=device, decode_capacities=(1,), prefill_capacities=catalog.prefill,
                             context_length=capacities.context_length, compile_model=compile_model,
                             prefill_chunk_size=chunk)
    pages = PageAllocator(num_pages)
    prefix_cache = PrefixCache(b"\x05" * 32, pages, PAGE_TOKENS, continuation_state=True, snapshot_rows=snapshots,
                               logits_rows=8)
    scheduler = Scheduler(SchedulerConfig(rows, chunk, catalog, PAGE_TOKENS),
                          KvCacheManager(pages, rows, PAGE_TOKENS, prefix_cache))
    generator = torch.Generator().manual_seed(7)

    def prompt(n: int) -> list[int]:
        return torch.randint(1000, 100000, (n,), generator=generator).tolist()

    def seconds_to_first_token(request_id: str, tokens: list[int]) -> tuple[float, int]:
        torch.cuda.synchronize()
        start = time.perf_counter()
        scheduler.submit(request_id, tokens, max_tokens=1, message_ends=(prefix,))
        restored = 0
        while not scheduler.is_idle():
            plan = scheduler.schedule()
            if plan is None:
                break
            restored += sum(r.snapshot_row is not None for r in plan.restores)
            sampled = executor.run(plan).argmax(-1)
            executor.record_sampled([h.state_row for h in plan.samples], sampled)
            for done in scheduler.complete(plan, StepResult(sampled.tolist(), plan.estimated_s)):
                scheduler.finish(done.handle.request_id, "length")
        return time.perf_counter() - start, restored

    seconds_to_first_token("warm-up", prompt(prefix + suffix))  # kernels tuned for these lengths
    shared = prompt(prefix)
    cold, cold_restores = seconds_to_first_token("cold", shared + prompt(suffix))
    warm, warm_restores = seconds_to_first_token("warm", shared + prompt(suffix))
    if cold_restores or not warm_restores:
        raise RuntimeError(f"expected no restore cold and one warm, got {cold_restores} and {warm_restores}")
    if profile is not None:
        write_profile(profile, lambda: seconds_to_first_token("warm-profiled", shared + prompt(suffix)))
    return {"prefix_tokens": prefix, "suffix_tokens": suffix, "chunk_tokens": chunk,
            "prefill_graph_replays": sum(g.replays for g in executor.graphs.prefill_graphs.values()),
            "cold_ms": round(1000 * cold, 1), "warm_ms": round(1000 * warm, 1),
            "warm_over_cold": round(warm / cold, 3)}


def write_profile(path: Path, run) -> None:
    """Where `run`'s time goes: kernels by device time, then operators by host time."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    averages = prof.key_averages()
    path.write_text(averages.table(sort_by="cuda_time_total", row_limit=60, max_name_column_width=90) + "\n"
                    + averages.table(sort_by="cpu_time_total", row_limit=40, max_name_column_width=90))


def shape(name: str):
    """(config, recipe, MoE layers, description) of a named shape."""
    if name == "qwen3.5":
        from transformers import Qwen3_5TextConfig

        from flare_recipe_qwen.recipes import QWEN3_5

        return Qwen3_5TextConfig(), QWEN3_5, 0, "qwen3.5 default text (Qwen3_5TextConfig())"
    if name == "kimi-linear":
        from transformers import KimiLinearConfig

        from flare_recipe_kimi.recipes import KIMI_LINEAR

        config = KimiLinearConfig(**json.loads(KIMI_LINEAR_CONFIG.read_text()))
        return config, KIMI_LINEAR, config.mlp_layer_types.count("sparse"), "Kimi Linear 48B-A3B (published config)"
    raise SystemExit(f"--shape: unknown {name!r}")


def main() -> None:
    from flare_core.plugins import load_registry

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3.5", choices=["qwen3.5", "kimi-linear"])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--context", type=int, default=1024, help="prompt tokens per request before decoding")
    parser.add_argument("--steps", type=int, default=128, help="timed decode steps per batch")
    parser.add_argument("--prefix-tokens", type=int, default=4096)
    parser.add_argument("--suffix-tokens", type=int, default=96)
    parser.add_argument("--chunk", type=int, default=2048, help="prompt chunk tokens (the export's default)")
    parser.add_argument("--eager-layers", action="store_true", help="capture the decoder layers without "
                        "torch.compile (what `flare run --no-compile` serves; faster to start, for profiles of "
                        "the opaque kernels)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--profile", type=Path, help="a folder for profiles of the first batch's decode steps "
                        "and of a restored prompt's first token")
    args = parser.parse_args()
    device = torch.device("cuda")
    bandwidth = copy_bandwidth(device)
    config, recipe, moe_layers, description = shape(args.shape)
    model = random_serving_model(config, device, recipe)
    weight_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    scheme = load_registry().cache_schemes[recipe.cache_scheme].build(config, "bfloat16")
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
    compile_model = not args.eager_layers
    runs = decode(config, model, recipe, device, args.batch, args.context, args.steps,
                  args.profile / "decode.txt" if args.profile else None, compile_model)
    print("decode", runs, flush=True)
    # Per request and step: its state rows read and written, its K/V pages read.
    per_request = 2 * scheme.state_row_bytes() + (args.context + args.steps) * scheme.page_bytes(PAGE_TOKENS) // PAGE_TOKENS
    embedding = 0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size * 2
    roofline = {}
    for batch in args.batch:
        weights_read = roofline_tok_s(config, moe_layers, weight_bytes, batch, bandwidth)[1] if moe_layers else \
            weight_bytes - embedding
        step_bytes = weights_read + batch * per_request
        tok_s = batch * bandwidth / step_bytes
        roofline[str(batch)] = {"tok_s": round(tok_s, 1), "bytes_per_step": step_bytes,
                                "fraction": round(runs[str(batch)]["decode_tok_s"] / tok_s, 3)}
    ttft = first_token(config, model, recipe, device, args.prefix_tokens, args.suffix_tokens, args.chunk,
                       args.profile / "first_token.txt" if args.profile else None, compile_model)
    print("first token", ttft, flush=True)
    result = {"benchmark": "hybrid_decode", "shape": description,
              "weight_bytes": weight_bytes, "state_bytes_per_request": scheme.state_row_bytes(),
              "copy_bandwidth_gb_s": round(bandwidth / 1e9, 1), "decode": runs, "roofline": roofline,
              "first_token": ttft, "context": args.context, "steps": args.steps, "compiled_layers": compile_model,
              "device": torch.cuda.get_device_name(device), "torch": torch.__version__, **commit_and_date()}
    report(result, args.out)


if __name__ == "__main__":
    main()
