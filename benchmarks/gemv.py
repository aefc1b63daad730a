"""One-token matmuls on Qwen3-8B's (or, `--shape kimi-linear`, Kimi Linear 48B-A3B's) weight shapes: cuBLAS (F.linear) vs Flare's Triton GEMV
(flare_core.kernels.gemv), side by side in one run, with a sweep of the kernel's launch
configurations. With `--tokens 2,4,8,16`: matmuls of that many tokens, cuBLAS vs the few-token
kernel (`gemv_tokens`) and its sweep, the one-token kernel's time beside them.

Each figure is the device time of one call inside a CUDA graph that calls the op over enough
distinct weight matrices (>= 2 GiB in all) that none is still in the 50 MB L2 cache when its
turn comes, as in a decode step where each layer reads its own weights once.

    python benchmarks/gemv.py --out benchmarks/results/h200-gemv.json
    python benchmarks/gemv.py --shape kimi-linear --out benchmarks/results/h200-gemv-kimi-linear.json
    python benchmarks/gemv.py --tokens 2,4,8,16 --out benchmarks/results/h200-gemv-tokens.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.runtime.errors import OutOfResources

from flare_core.kernels.gemv import FewTokensConfig, GemvConfig, gemv, gemv_config, gemv_tokens

# --shape -> {name -> (out_features, in_features, gated)}.
SHAPES = {
  # Qwen3-8B (hidden 4096, 32/8 heads of 128, MLP 12288).
  "qwen3-8b": {
    "qkv_proj": (6144, 4096, False),
    "o_proj": (4096, 4096, False),
    "gate_up_proj": (24576, 4096, False),
    "gate_up_proj + silu*up": (24576, 4096, True),
    "down_proj": (4096, 12288, False),
    "lm_head": (151936, 4096, False),
  },
  # Kimi Linear 48B-A3B as published (hidden 2304; KDA: 32 heads of 128, the low-rank forget gate
  # and output gate of rank 128; MLA: 32 heads, q without low rank, latent 512 + 64; MoE: router of
  # 256 experts, shared expert 1024; the dense first layer's MLP 9216; vocab 163840).
  "kimi-linear": {
    "kda qkv_proj": (12288, 2304, False),
    "kda qkv + f_a + g_a + b": (12576, 2304, False),
    "kda f_b / g_b": (4096, 128, False),
    "o_proj": (2304, 4096, False),
    "mla q_proj": (6144, 2304, False),
    "mla kv_a_proj_with_mqa": (576, 2304, False),
    "router": (256, 2304, False),
    "shared expert gate_up + silu*up": (2048, 2304, True),
    "shared expert down": (2304, 1024, False),
    "dense gate_up + silu*up": (18432, 2304, True),
    "dense down": (2304, 9216, False),
    "lm_head": (163840, 2304, False),
  },
  # DeepSeek V4 Flash's decoder-layer linears (Transformers 5.23's DeepseekV4Config defaults:
  # hidden 4096, q rank 1024, 64 heads of 512, one KV head, 8 output groups of rank 1024, the CSA
  # compressor and its indexer of 64 heads of 128, a shared expert of 2048), FP8 blocks as published.
  "deepseek-v4-flash": {
    "q_a_proj": (1024, 4096, False),
    "q_b_proj": (32768, 1024, False),
    "kv_proj": (512, 4096, False),
    "o_a_proj (one group)": (1024, 4096, False),
    "o_b_proj": (4096, 8192, False),
    "compressor kv_proj / gate_proj": (1024, 4096, False),
    "indexer kv_proj / gate_proj": (256, 4096, False),
    "indexer q_b_proj": (8192, 1024, False),
    "indexer weights_proj": (64, 4096, False),
    "shared expert gate_up + silu*up": (4096, 4096, True),
    "shared expert down": (4096, 2048, False),
  },
}
ROTATION_BYTES = 2 * 2**30


def sweep_configs() -> list[GemvConfig]:
    configs = []
    for rows in (1, 2, 4, 8, 16, 32):
        for columns in (128, 256, 512, 1024, 2048):
            if 256 <= rows * columns <= 16384:
                configs += [GemvConfig(rows, columns, warps, stages) for warps in (4, 8) for stages in (1, 3)]
    return configs


def cublas_call(x: torch.Tensor, gated: bool):
    """F.linear of `x` by a weight (gated: then silu(gate) * up of its halves), as the layers call cuBLAS."""
    def call(w: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, w)
        if gated:
            gate, up = y.chunk(2, dim=-1)
            y = F.silu(gate) * up
        return y
    return call


def rotated_weights(n: int, k: int, device: torch.device, generator: torch.Generator) -> list[torch.Tensor]:
    """Copies of a random [n, k] bf16 weight, enough (>= ROTATION_BYTES) that none stays in L2."""
    copies = max(2, min(64, math.ceil(ROTATION_BYTES / (n * k * 2))))
    return [torch.randn(n, k, device=device, dtype=torch.bfloat16, generator=generator) * 0.02 for _ in range(copies)]


def few_tokens_configs() -> list[FewTokensConfig]:
    return [FewTokensConfig(rows, columns, warps, stages) for rows in (16, 32, 64) for columns in (64, 128, 256)
            for warps in (4, 8) for stages in (2, 3, 4)]


def device_us(call, weights: list[torch.Tensor], replays: int = 5) -> float:
    """Device microseconds per call of `call(weight)`, over graphs of one call per weight (or
    per item of `weights`)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for w in weights[:2]:
            call(w)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            call(w)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return 1000 * start.elapsed_time(end) / (replays * len(weights))


def launch_effect(device: torch.device, generator: torch.Generator, layers: int = 36) -> dict:
    """Device time per layer of a decode layer's four GEMVs in a row (qkv, o, gate_up + silu,
    down; each reading the one before's output), launched plainly and as programmatic dependents."""
    from dataclasses import replace

    shapes = ((6144, 4096, False), (4096, 4096, False), (24576, 4096, True), (4096, 12288, False))
    weights = [[torch.randn(n, k, device=device, dtype=torch.bfloat16, generator=generator) * 0.02
                for n, k, _ in shapes] for _ in range(layers)]
    x = torch.randn(4096, device=device, dtype=torch.bfloat16, generator=generator)
    row = {}
    for pdl in (False, True):
        configs = [replace(gemv_config(n // 2 if gated else n, k, gated), pdl=pdl) for n, k, gated in shapes]

        def layer(i):
            y = x
            for w, config, (n, k, gated) in zip(weights[i], configs, shapes):
                y = gemv(y[:k], w, config, gated=gated)
        row["programmatic dependent launch" if pdl else "plain launch"] = round(device_us(layer, list(range(layers))), 2)
    return {"us_per_layer": row}


def few_tokens(shapes: dict, token_counts: list[int], device: torch.device, generator: torch.Generator) -> dict:
    """Per shape and token count: cuBLAS, the few-token kernel's sweep (best first), and the
    one-token kernel's time for one token (what a decode step of one row pays)."""
    results = {}
    for name, (n, k, gated) in shapes.items():
        bytes_per_weight = n * k * 2
        weights = rotated_weights(n, k, device, generator)
        row = {"shape": [n, k], "gated": gated, "copies": len(weights)}
        shipped = gemv_config(n // 2 if gated else n, k, gated)
        if shipped is not None:
            one = torch.randn(k, device=device, dtype=torch.bfloat16, generator=generator)
            row["one_token_kernel_us"] = round(device_us(lambda w: gemv(one, w, shipped, gated=gated), weights), 2)
        for tokens in token_counts:
            x = torch.randn(tokens, k, device=device, dtype=torch.bfloat16, generator=generator)
            sweep, too_large = [], []
            for config in few_tokens_configs():
                if k % config.columns:
                    continue
                try:  # the first call compiles, outside any graph capture
                    us = device_us(lambda w: gemv_tokens(x, w, config, gated=gated), weights)
                except OutOfResources:  # its tiles and stages need more shared memory than an SM has
                    too_large.append(config.__dict__)
                    continue
                sweep.append({"us": round(us, 2), "tb_s": round(bytes_per_weight / us / 1e6, 3),
                              "config": config.__dict__})
            sweep.sort(key=lambda r: r["us"])
            row[f"{tokens} tokens"] = {"cublas_us": round(device_us(cublas_call(x, gated), weights), 2),
                                       "kernel_best": sweep[:4], "kernel_worst_us": sweep[-1]["us"],
                                       "too_large": too_large}
        results[name] = row
        print(name, json.dumps({key: (value if not isinstance(value, dict) else
                                      {"cublas_us": value["cublas_us"], "best": value["kernel_best"][0]})
                                for key, value in row.items()}), flush=True)
        del weights
        torch.cuda.empty_cache()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--shape", default="qwen3-8b", choices=list(SHAPES))
    parser.add_argument("--no-sweep", action="store_true", help="only cuBLAS and the shipped configuration")
    parser.add_argument("--tokens", help="comma-separated token counts: matmuls of a few tokens")
    args = parser.parse_args()
    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(0)
    results = {}
    if args.tokens:
        results = few_tokens(SHAPES[args.shape], [int(t) for t in args.tokens.split(",")], device, generator)
        write(args, results, device)
        return
    for name, (n, k, gated) in SHAPES[args.shape].items():
        bytes_per_weight = n * k * 2
        weights = rotated_weights(n, k, device, generator)
        copies = len(weights)
        x = torch.randn(1, k, device=device, dtype=torch.bfloat16, generator=generator)
        reference = F.linear(x.float(), weights[0].float())[0]
        if gated:
            gate, up = reference.chunk(2)
            reference = F.silu(gate) * up
        cublas = cublas_call(x, gated)

        def kernel(config):
            return lambda w: gemv(x[0], w, config, gated=gated)

        def entry(us: float) -> dict:
            return {"us": round(us, 2), "tb_s": round(bytes_per_weight / us / 1e6, 3)}

        row = {"shape": [n, k], "gated": gated, "copies": copies, "cublas": entry(device_us(cublas, weights))}
        shipped = gemv_config(n // 2 if gated else n, k, gated)
        if shipped is not None:
            error = (gemv(x[0], weights[0], shipped, gated=gated).float() - reference).abs().max().item()
            row["flare"] = {**entry(device_us(kernel(shipped), weights)), "config": shipped.__dict__,
                            "max_abs_error": error, "max_abs_reference": reference.abs().max().item()}
        if not args.no_sweep:
            sweep = []
            for config in sweep_configs():
                if k % config.columns:
                    continue
                sweep.append({**entry(device_us(kernel(config), weights)), "config": config.__dict__})
            sweep.sort(key=lambda r: r["us"])
            row["sweep_best"] = sweep[:8]
            row["sweep_worst"] = sweep[-1]
        results[name] = row
        print(name, json.dumps({key: value for key, value in row.items() if key != "sweep_best"}),
              "best:", row.get("sweep_best", [None])[0], flush=True)
        del weights
        torch.cuda.empty_cache()
    results["four GEMVs of a layer in a row"] = launch_effect(device, generator)
    print(json.dumps(results["four GEMVs of a layer in a row"]), flush=True)
    write(args, results, device)


def write(args: argparse.Namespace, results: dict, device: torch.device) -> None:
    result = {"shape": args.shape, "tokens": args.tokens, "results": results,
              "device": torch.cuda.get_device_name(device), "torch": torch.__version__,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
