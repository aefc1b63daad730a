"""DeepSeek V4.1 decode on the CUDA runner at V4.1 Flash's per-layer shapes (#48's targets for V4.1).

`DeepseekV41TextConfig`'s defaults are V4.1 Flash's shapes (hidden 5120, 64 heads of 512 over one
shared K = V latent, a 128-token window, 384 routed experts of 2304, top-6, an indexer of 32 heads
of 128 keeping 512, 4 mHC streams); the depth is cut to `--layers` (default 4, the config's own
schedule for that depth: two sliding-window layers, a ratio-2 group, a ratio-1 group whose source
is also the candidate source: every attention kind), no Engram layer (their rows are read on the
host and staged before each captured step: not what this measures), random weights, the
routed experts packed FP4 as published, with `--fp8` the linear weights and the shared expert FP8
blocks (the published V4.1 keeps 32 x 32 blocks, which the core does not take: see
docs/benchmarks.md). As benchmarks/deepseek_v4_decode.py (whose step loop this uses): requests'
pages held, not prefilled; per context the ms per decode step and the bytes it must read against
the device's copy bandwidth; the 131,072 / 4,096 step ratio.

    python3 benchmarks/deepseek_v41_decode.py --fp8 --out benchmarks/results/h200-deepseek-v41.json
    python3 benchmarks/deepseek_v41_decode.py --tiny --device cpu --contexts 256,512 --steps 4   # a smoke run
"""

from __future__ import annotations

import sys

import torch

from deepseek_v4_decode import active_weight_bytes, decode_arguments, decode_figures, decode_times, random_model
from provenance import commit_and_date, report


def v41_config(layers: int, tiny: bool, engram_buckets: int = 0):
    """V4.1 Flash's shapes at `layers` layers, or (`tiny`) the same schedule at flare_testing's tiny
    widths; without Engram layers, or (`engram_buckets` > 0) with one at layer 1 whose table holds
    that many rows per n-gram size and head (the published model: 16 M) instead of V4.1 Flash's."""
    from flare_recipe_deepseek.v41_config import DeepseekV41TextConfig
    from flare_recipe_deepseek.v41_engram import bucket_primes

    small = dict(vocab_size=512, hidden_size=64, num_attention_heads=4, head_dim=64, q_lora_rank=32,
                 qk_rope_head_dim=16, sliding_window=16, index_n_heads=4, index_head_dim=32, index_topk=8,
                 o_groups=2, o_lora_rank=16, moe_intermediate_size=64, n_routed_experts=16,
                 candidate_topk_blocks=4, candidate_block_size=4, engram_head_dim=16) if tiny else {}
    if not engram_buckets:
        return DeepseekV41TextConfig(num_hidden_layers=layers, engram_layer_ids=[], **small)
    config = DeepseekV41TextConfig(num_hidden_layers=layers, engram_layer_ids=[1], engram_vocab_size=engram_buckets,
                                   **small)
    config.engram_num_embeddings = [sum(sum(sizes) for sizes in layer) for layer in bucket_primes(config)]
    return config


def host_tables(config) -> dict:
    """Random rows in host memory (as `flare run --embedding-table-storage ram` holds them) for the
    Engram tables of `config`'s model, by prepared tensor name."""
    from flare_core.ops.tables import embedding_tables
    from flare_recipe_deepseek.v41 import build_model

    generator = torch.Generator().manual_seed(1)
    tables = {name: (torch.randn(t.rows, t.width, generator=generator) * 0.02).to(torch.bfloat16)
              for name, t in embedding_tables(build_model(config, torch.bfloat16)).items()}
    return {name: table.pin_memory() if torch.cuda.is_available() else table for name, table in tables.items()}


def step_cache_bytes(config, context: int) -> int:
    """What one decode step reads of the caches at `context` tokens, per request, bf16: every layer
    its window; each index source every indexer key of its group; each compressed layer the
    entries picked (at most `index_topk`)."""
    total = 0
    for layer, ratio in enumerate(config.compress_ratios[:config.num_hidden_layers]):
        total += config.sliding_window * config.head_dim * 2
        if ratio:
            records = context // ratio
            total += min(records, config.index_topk) * config.head_dim * 2
            if layer in config.index_source_layer_ids:
                total += records * config.index_head_dim * 2
    return total


def main() -> None:
    parser = decode_arguments(__doc__)
    parser.add_argument("--tiny", action="store_true", help="tiny widths (a smoke run of the script)")
    parser.add_argument("--fp8", action="store_true", help="the linear weights and the shared expert as FP8 blocks")
    parser.add_argument("--engram", type=int, default=0, metavar="BUCKETS",
                        help="an Engram layer (layer 1) whose table, in host memory, holds BUCKETS rows per n-gram "
                             "size and head: each decode step's rows staged before its graph replays")
    args = parser.parse_args()
    from flare_recipe_deepseek.v41 import shared_compressed_attention_scheme
    from flare_recipe_deepseek.v41_recipe import DEEPSEEK_V41

    device = torch.device(args.device)
    config = v41_config(args.layers, args.tiny, args.engram)
    contexts = [int(c) for c in args.contexts.split(",")]
    tables = host_tables(config) if args.engram else {}
    model, routed_bytes, embedding_bytes, weight_bytes = random_model(config, device, args.fp8, DEEPSEEK_V41,
                                                                      "model.embed.weight", tables)
    if args.engram:  # hashes over a random token map (a zero one would read the same rows every step)
        token_map = model.model.ngram.token_map
        token_map.copy_(torch.randint(0, config.engram_compressed_vocab_size, token_map.shape, device=device))
    table_bytes = sum(t.numel() * t.element_size() for t in tables.values())
    active = active_weight_bytes(config, args.rows, weight_bytes, embedding_bytes, routed_bytes)
    times = decode_times(model, config, device, contexts, args.steps, args.rows, not args.no_compile, args.profile,
                         shared_compressed_attention_scheme(config, "bfloat16"))
    report({**commit_and_date(), "command": "python3 " + " ".join(sys.argv),
            "layers": config.num_hidden_layers, "compress_ratios": config.compress_ratios[:config.num_hidden_layers],
            "rows": args.rows, "compiled": not args.no_compile, "engram_table_bytes_host": table_bytes,
            "linear_weights": "fp8 blocks" if args.fp8 else "bfloat16",
            "weight_bytes": weight_bytes, "routed_expert_bytes_fp4": routed_bytes,
            "active_weight_bytes_per_step": active,
            **decode_figures(times, active, args.rows, lambda context: step_cache_bytes(config, context), device),
            "bench_c32_output_tok_s": None}, args.out)


if __name__ == "__main__":
    main()
