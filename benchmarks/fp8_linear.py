"""FP8 block-scaled linear layers against bf16 on Qwen3-8B's weight shapes, side by side in one
run, at 1 to 2,048 tokens: the bf16 path (Flare's GEMV at one token, cuBLAS otherwise), Flare's
FP8 path (`flare::fp8_linear`: FP8 GEMV at one token, activation quantization + cuBLAS block-scaled
FP8 GEMM otherwise), and the FP8 weight dequantized to bf16 before F.linear (what the op falls
back to), with a sweep of the FP8 GEMV's launch configurations at one token.

Each figure is the device time of one call inside a CUDA graph that calls the op over enough
distinct weight matrices (>= 2 GiB of bf16 weights in all) that none is still in the L2 cache
when its turn comes (benchmarks/gemv.py's method).

    python benchmarks/fp8_linear.py --out benchmarks/results/h200-fp8-linear.json
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

from flare_core.ops.fp8 import dequantize_blocks, quantize_blocks
from flare_core.ops.gemv import GemvConfig, _gemv_path, gemv
from gemv import ROTATION_BYTES, SHAPES, device_us, sweep_configs

TOKENS = (1, 8, 64, 256, 2048)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--no-sweep", action="store_true", help="only the shipped GEMV configuration")
    args = parser.parse_args()
    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(0)
    results = {}
    for name, (n, k, gated) in SHAPES.items():
        if name == "lm_head":  # the head stays bf16
            continue
        copies = max(2, min(64, math.ceil(ROTATION_BYTES / (n * k * 2))))
        bf16 = [torch.randn(n, k, device=device, dtype=torch.bfloat16, generator=generator) * 0.02
                for _ in range(copies)]
        fp8 = [quantize_blocks(w) for w in bf16]
        row = {"shape": [n, k], "gated": gated, "copies": copies}
        for tokens in TOKENS:
            if gated and tokens > 1:
                continue
            x = torch.randn(tokens, k, device=device, dtype=torch.bfloat16, generator=generator)

            def bf16_call(w):
                if gated:
                    return torch.ops.flare.gated_linear(x, w)
                return torch.ops.flare.linear(x, w)

            def fp8_call(pair):
                if gated:
                    return torch.ops.flare.fp8_gated_linear(x, *pair)
                return torch.ops.flare.fp8_linear(x, *pair)

            def dequantized_call(pair):
                return F.linear(x, dequantize_blocks(*pair, dtype=torch.bfloat16))

            exact = F.linear(x.float(), dequantize_blocks(*fp8[0]))
            if gated:
                gate, up = exact.chunk(2, dim=-1)
                exact = F.silu(gate) * up
            error = (fp8_call(fp8[0]).float() - exact).abs().max().item() / exact.abs().max().item()
            bf16_us, fp8_us = device_us(bf16_call, bf16), device_us(fp8_call, fp8)
            entry = {"bf16_us": round(bf16_us, 2), "fp8_us": round(fp8_us, 2),
                     "speedup": round(bf16_us / fp8_us, 3),
                     "fp8_weight_tb_s": round(n * k / fp8_us / 1e6, 3),
                     "fp8_max_error_of_max": round(error, 5)}
            if tokens > 1:
                entry["dequantized_us"] = round(device_us(dequantized_call, fp8[:4]), 2)
            row[f"tokens_{tokens}"] = entry
            print(name, tokens, json.dumps(entry), flush=True)
        if not args.no_sweep:
            x = torch.randn(k, device=device, dtype=torch.bfloat16, generator=generator)
            shipped = _gemv_path(x, fp8[0][0], n // 2 if gated else n, gated=gated, scaled=True)
            sweep = []
            for config in sweep_configs() + [GemvConfig(rows, 4096, 4, 1) for rows in (1, 2)]:
                if k % config.columns or 128 % config.rows:
                    continue
                config = replace(config, pdl=shipped.pdl)
                us = device_us(lambda pair: gemv(x, pair[0], config, gated=gated, scale=pair[1]), fp8)
                sweep.append({"us": round(us, 2), "tb_s": round(n * k / us / 1e6, 3), "config": config.__dict__})
            sweep.sort(key=lambda r: r["us"])
            row["gemv_shipped_config"] = shipped.__dict__
            row["gemv_sweep_best"] = sweep[:6]
            print(name, "sweep best:", sweep[0], flush=True)
        results[name] = row
        del bf16, fp8
        torch.cuda.empty_cache()
    result = {"results": results, "device": torch.cuda.get_device_name(device), "torch": torch.__version__,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
