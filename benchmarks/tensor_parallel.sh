#!/usr/bin/env bash
# #49's figures on a machine of two GPUs, each run a real `flare run` from cold and `flare bench`
# random 1024 / 256 at c=1 (8 prompts) and c=64 (256), every state row free after the load:
#   dense  Qwen3-32B's per-layer shapes (hidden 5120, intermediate 25600, 64 / 8 heads; random bf16)
#          at LAYERS layers over two ranks (`--tp 2`, `flare run --gpus 0,1`) against one GPU serving
#          the same shape at LAYERS / 2 (one rank's share of the weights): the one-GPU figure of the
#          whole depth is taken as the cut model's tok/s x 1/2, and #49 asks TP2 >= 1.7x it and >= 75 %
#          of the two GPUs' bandwidth roofline (each rank reads half the weights a token).
#   moe    Qwen3-30B-A3B's shape at 12 layers (the MoE issue's) on one GPU, over two ranks with the
#          experts tensor-parallel (`--tp 2`) and expert-parallel (`--tp 2 --expert-parallel`).
# A checkpoint is deleted once exported (a 40-layer one and its core are 2 x 42 GB of the host's disk).
# Figures to OUTDIR/summary.json (tok/s, TPOT, start-up, failures; dense: the speedup and roofline).
#   bash benchmarks/tensor_parallel.sh OUTDIR dense|moe [LAYERS (dense, default 40)]
#   bash benchmarks/tensor_parallel.sh OUTDIR smoke    (tiny dense widths on the CPU: the script's own check)
set -euo pipefail
invocation="bash $0 $*"
out=${1:?usage: tensor_parallel.sh OUTDIR dense|moe|smoke [LAYERS]}; kind=${2:?dense, moe or smoke}
layers=${3:-40}
work=/tmp/flare-bench; mkdir -p "$work" "$out"
source benchmarks/flare_server.sh
write_config "$work"
flare="python3 -m flare_core.cli --config $work/config.toml"
concurrencies="1 64"; one_gpu=(); two_gpus=(--gpus 0,1)
shape=(--hidden 5120 --intermediate 25600 --heads 64)
if [ "$kind" = smoke ]; then
  concurrencies="1"; one_gpu=(--device cpu); two_gpus=(--device cpu); shape=(--hidden 256 --intermediate 512 --heads 16)
  layers=4
fi

# core NAME WRITE_FLAGS EXPORT_FLAGS: export a random checkpoint (written unless its core exists), delete
# the checkpoint, record its weight bytes in $work/NAME.bytes; prints the core's path.
core() {
  local name=$1 write=$2 flags=$3
  if [ ! -f "$work/$name.core" ]; then
    [ -d "$work/$name" ] || python3 benchmarks/random_checkpoint.py $write "$work/$name" > /dev/null
    du -cb "$work/$name"/*.safetensors | tail -1 | cut -f1 > "$work/$name.bytes"
    $flare export "$work/$name" $flags --no-progress --max-concurrency 64 --context-length 4096 \
      > "$work/$name.export.log" 2>&1 || { tail -20 "$work/$name.export.log"; exit 1; }
    tail -1 "$work/$name.export.log" > "$work/$name.core"
    rm -rf "${work:?}/$name"
  fi
  cat "$work/$name.core"
}

run() {  # RUN CORE [flare run flags]: one steady run, its start-up seconds in RUN/startup.txt
  local name=$1 path=$2; shift 2
  steady_run "$out/$name" "$concurrencies" "$path" "$@"
  echo "$startup_s" > "$out/$name/startup.txt"
}

case $kind in
  dense|smoke)
    run one-gpu "$(core "qwen3-$((layers / 2))l" "--layers $((layers / 2)) ${shape[*]}" "")" "${one_gpu[@]}"
    run tp2 "$(core "qwen3-${layers}l-tp2" "--layers $layers ${shape[*]}" "--tp 2")" "${two_gpus[@]}"
    cp "$work/qwen3-$((layers / 2))l.bytes" "$out/one-gpu/weight_bytes.txt"
    cp "$work/qwen3-${layers}l-tp2.bytes" "$out/tp2/weight_bytes.txt"
    runs="one-gpu tp2" ;;
  moe)
    run one-gpu "$(core qwen3-moe-12l "--moe" "")"
    run tp2 "$(core qwen3-moe-12l-tp2 "--moe" "--tp 2")" "${two_gpus[@]}"
    run tp2-expert-parallel "$(core qwen3-moe-12l-tp2-ep "--moe" "--tp 2 --expert-parallel")" "${two_gpus[@]}"
    runs="one-gpu tp2 tp2-expert-parallel" ;;
  *) echo "unknown kind $kind (dense, moe or smoke)"; exit 2 ;;
esac

python3 - "$out" "$kind" "$runs" "$concurrencies" "$invocation" <<'PY'
import json, sys
from pathlib import Path
out, kind, runs, concurrencies, command = Path(sys.argv[1]), sys.argv[2], sys.argv[3].split(), sys.argv[4].split(), sys.argv[5]
sys.path.insert(0, "benchmarks")
from provenance import commit_and_date
import torch

summary = {**commit_and_date(), "command": command, "kind": kind, "runs": {}}
for run in runs:
    figures = {"startup_cold_s": float((out / run / "startup.txt").read_text())}
    for c in concurrencies:
        m = json.loads((out / run / f"bench-c{c}.json").read_text())["metrics"]
        figures[f"c{c}"] = {"output_tok_s": m["output_throughput"], "tpot_p50_ms": m["tpot_ms"]["median"],
                            "ttft_p50_ms": m["ttft_ms"]["median"], "failed": m["failed"]}
    figures["gauges_after"] = (out / run / "slots.txt").read_text().splitlines()[0]
    summary["runs"][run] = figures
if kind != "moe":
    one, two = summary["runs"]["one-gpu"], summary["runs"]["tp2"]
    # The cut model is half the depth: one GPU serving the whole depth would take twice its time a token.
    summary["tp2_speedup_c1"] = two["c1"]["output_tok_s"] / (one["c1"]["output_tok_s"] / 2)
    summary["target_tp2_speedup_c1"] = 1.7
    if torch.cuda.is_available():
        source = torch.empty(2 ** 30, dtype=torch.uint8, device="cuda")
        target = torch.empty_like(source)
        for _ in range(3):
            target.copy_(source)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            target.copy_(source)
        end.record()
        torch.cuda.synchronize()
        bandwidth = 2 * 10 * source.numel() / (start.elapsed_time(end) / 1e3)  # read + write bytes a second
        weights = int((out / "tp2" / "weight_bytes.txt").read_text())
        summary["copy_bandwidth_bytes_s"] = bandwidth
        # Each rank reads its half of the weights a token (the KV cache of 1,280 tokens is small beside it).
        summary["tp2_roofline_fraction_c1"] = (weights / 2 / bandwidth) / (two["c1"]["tpot_p50_ms"] / 1e3)
        summary["target_tp2_roofline_fraction_c1"] = 0.75
(out / "summary.json").write_text(json.dumps(summary, indent=1))
print(json.dumps(summary, indent=1))
PY
