"""FP8 block-scaled linear layers against bf16 on one model's weight shapes (`--shape`, Qwen3-8B's
by default; benchmarks/gemv.py's SHAPES), side by side in one
run, at 1 to 2,048 tokens: the bf16 path (Flare's GEMV at one token, cuBLAS otherwise), Flare's
FP8 path (`flare::fp8_linear`), and each FP8 route on its own: the FP8 GEMV (one token), the
Triton kernel widening FP8 tiles for 16-bit tensor-core dots (`fp8_mm`), activation quantization +
cuBLAS's block-scaled FP8 GEMM (`block_scaled_mm`), and the weight dequantized before F.linear;
with sweeps of the FP8 GEMV's and `fp8_mm`'s launch configurations.

Each figure is the device time of one call inside a CUDA graph that calls the op over enough
distinct weight matrices (>= 2 GiB of bf16 weights in all) that none is still in the L2 cache
when its turn comes (benchmarks/gemv.py's method).

    python benchmarks/fp8_linear.py --out benchmarks/results/h200-fp8-linear.json
    python benchmarks/fp8_linear.py --shape deepseek-v4-flash --tokens 1 --out ...
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

from flare_core.kernels.fp8 import (_fp8_gemv_path, block_scaled_mm, dequantize_blocks, fp8_gemv, fp8_mm, quantize_blocks)
from flare_core.kernels.gemv import GemvConfig
from gemv import ROTATION_BYTES, SHAPES, device_us, sweep_configs

TOKENS = (1, 8, 16, 32, 64, 128, 256, 2048)
MM_SWEEP_TOKENS = (8, 64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--shape", default="qwen3-8b", choices=list(SHAPES))
    parser.add_argument("--no-sweep", action="store_true", help="only the shipped configurations")
    parser.add_argument("--tokens", help="comma-separated token counts (default: %s)" % ",".join(map(str, TOKENS)))
    parser.add_argument("--mm-sweep", action="store_true", help="also sweep fp8_mm's tiles at 8 and 64 tokens")
    args = parser.parse_args()
    token_counts = [int(t) for t in args.tokens.split(",")] if args.tokens else TOKENS
    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(0)
    results = {}
    for name, (n, k, gated) in SHAPES[args.shape].items():
        if name == "lm_head":  # the head stays bf16
            continue
        copies = max(2, min(64, math.ceil(ROTATION_BYTES / (n * k * 2))))
        bf16 = [torch.randn(n, k, device=device, dtype=torch.bfloat16, generator=generator) * 0.02
                for _ in range(copies)]
        fp8 = [quantize_blocks(w) for w in bf16]
        row = {"shape": [n, k], "gated": gated, "copies": copies}
        for tokens in token_counts:
            if gated and tokens > 1:
                continue
            x = torch.randn(tokens, k, device=device, dtype=torch.bfloat16, generator=generator)

            def bf16_call(w):
                return torch.ops.flare.gated_linear(x, w) if gated else torch.ops.flare.linear(x, w)

            def fp8_call(pair):
                return torch.ops.flare.fp8_gated_linear(x, *pair) if gated else torch.ops.flare.fp8_linear(x, *pair)

            exact = F.linear(x.float(), dequantize_blocks(*fp8[0]))
            if gated:
                gate, up = exact.chunk(2, dim=-1)
                exact = F.silu(gate) * up
            error = (fp8_call(fp8[0]).float() - exact).abs().max().item() / exact.abs().max().item()
            bf16_us, fp8_us = device_us(bf16_call, bf16), device_us(fp8_call, fp8)
            entry = {"bf16_us": round(bf16_us, 2), "fp8_us": round(fp8_us, 2), "speedup": round(bf16_us / fp8_us, 3),
                     "fp8_weight_tb_s": round(n * k / fp8_us / 1e6, 3), "fp8_max_error_of_max": round(error, 5)}
            if tokens > 1:
                entry["fp8_mm_us"] = round(device_us(lambda pair: fp8_mm(x, *pair), fp8), 2)
                entry["cublas_fp8_us"] = round(device_us(lambda pair: block_scaled_mm(x, *pair), fp8), 2)
                entry["dequantized_us"] = round(device_us(
                    lambda pair: F.linear(x, dequantize_blocks(*pair, dtype=torch.bfloat16)), fp8[:4]), 2)
            row[f"tokens_{tokens}"] = entry
            print(name, tokens, json.dumps(entry), flush=True)
        if not args.no_sweep:
            x = torch.randn(k, device=device, dtype=torch.bfloat16, generator=generator)
            shipped = _fp8_gemv_path(x, fp8[0][0], n // 2 if gated else n, gated=gated)
            sweep = []
            one_block = [GemvConfig(rows, 128, warps, stages) for rows in (16, 32, 64, 128) for warps in (4, 8)
                         for stages in (1, 3, 4)]
            for config in dict.fromkeys(sweep_configs() + one_block):  # the two lists share 128-column tiles
                if k % config.columns or 128 % config.rows:
                    continue
                config = replace(config, pdl=shipped.pdl)
                us = device_us(lambda pair: fp8_gemv(x, pair[0], pair[1], config, gated=gated), fp8)
                sweep.append({"us": round(us, 2), "tb_s": round(n * k / us / 1e6, 3), "config": config.__dict__})
            sweep.sort(key=lambda r: r["us"])
            row["gemv_shipped_config"] = shipped.__dict__
            row["gemv_sweep_best"] = sweep[:6]
            print(name, "GEMV sweep best:", sweep[:3], flush=True)
            if args.mm_sweep and not gated:
                for tokens in MM_SWEEP_TOKENS:
                    xs = torch.randn(tokens, k, device=device, dtype=torch.bfloat16, generator=generator)
                    mm_sweep = []
                    for block_n in (16, 32, 64, 128):
                        for warps in (4, 8):
                            for stages in (3, 4, 6):
                                us = device_us(lambda pair: fp8_mm(xs, *pair, block_n=block_n, warps=warps,
                                                                   stages=stages), fp8)
                                mm_sweep.append({"us": round(us, 2), "block_n": block_n, "warps": warps,
                                                 "stages": stages})
                    mm_sweep.sort(key=lambda r: r["us"])
                    row[f"fp8_mm_sweep_best_tokens_{tokens}"] = mm_sweep[:6]
                    print(name, tokens, "fp8_mm sweep best:", mm_sweep[:3], flush=True)
        results[name] = row
        del bf16, fp8
        torch.cuda.empty_cache()
    result = {"shape": args.shape, "results": results, "device": torch.cuda.get_device_name(device), "torch": torch.__version__,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
