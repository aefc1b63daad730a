#!/usr/bin/env bash
# DeepSeek V4 served (#48's serving targets): a random checkpoint as DeepSeek publishes V4 Flash, at its
# per-layer shapes cut to 4 layers (benchmarks/random_deepseek_v4.py: FP4 experts, FP8 blocks), exported
# with `--quantize fp8` (both kept packed), `flare run` from cold, `flare bench` random 4096 / 256 at
# concurrency 1 (4 prompts) and 32 (64 prompts), every request state row free again after the load,
# and the weight bytes: the checkpoint's files against what the server holds on the device (its
# "core loaded" line: parameters and buffers). Figures to OUTDIR/summary.json.
#   bash benchmarks/deepseek_v4_serving.sh OUTDIR [--tiny] [flare run flags, e.g. --no-compile]
#   bash benchmarks/deepseek_v4_serving.sh --prepare-only [--tiny]   (checkpoint + export, no serving:
#   the files stay in /tmp/flare-bench for the next call of a warm machine)
# --tiny: flare_testing's tiny V4 widths and 512-token prompts (a smoke run: add --device cpu).
set -euo pipefail
invocation="bash $0 $*"
out=${1:?usage: deepseek_v4_serving.sh OUTDIR|--prepare-only [--tiny] [flare run flags]}; shift
tiny=""; [ "${1:-}" = --tiny ] && { tiny=--tiny; shift; }
name=deepseek-v4-4l-random${tiny:+-tiny}
context=$([ -n "$tiny" ] && echo 1024 || echo 8192); prompt=$([ -n "$tiny" ] && echo 512 || echo 4096)
work=/tmp/flare-bench; mkdir -p "$work"
source benchmarks/flare_server.sh
write_config "$work"
flare="python3 -m flare_core.cli --config $work/config.toml"
[ -d "$work/$name" ] || python3 benchmarks/random_deepseek_v4.py $tiny "$work/$name"
if [ ! -f "$work/$name.core" ]; then
  $flare export "$work/$name" --quantize fp8 --no-progress --max-concurrency 32 --context-length $context \
    > "$work/$name.export.log" 2>&1 || { tail -20 "$work/$name.export.log"; exit 1; }
  tail -1 "$work/$name.export.log" > "$work/$name.core"
fi
[ "$out" = --prepare-only ] && exit 0
mkdir -p "$out"
cp "$work/$name.export.log" "$out/export.log"
start_server "$(cat "$work/$name.core")" "$out/run.log" "$@"
trap 'kill -TERM $server 2>/dev/null || true' EXIT  # a failed step leaves no server behind
echo "startup_cold_s $startup_s" | tee "$out/startup.txt"
for c in 1 32; do
  $flare bench --dataset random --random-input-len $prompt --random-output-len 256 --ignore-eos --max-concurrency $c \
    --num-prompts $([ $c = 1 ] && echo 4 || echo 64) --result-file "$out/bench-c$c.json" 2>&1 | tail -12
done
check_slots_free 32 "$out/slots.txt"
kill -TERM $server; wait $server || true
python3 - "$out" "$work/$name" "$startup_s" "$invocation" <<'PY'
import json, re, sys
from pathlib import Path
out, checkpoint, startup, command = Path(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
sys.path.insert(0, "benchmarks")
from provenance import commit_and_date
loaded = next(line for line in (out / "run.log").read_text().splitlines() if "core loaded" in line)
bench = {c: json.loads((out / f"bench-c{c}.json").read_text())["metrics"] for c in (1, 32)}
summary = {**commit_and_date(), "command": command,
           "startup_cold_s": startup,
           "checkpoint_weight_bytes": sum(f.stat().st_size for f in checkpoint.glob("*.safetensors")),
           "device_weight_bytes": round(float(re.search(r"weights_mib=([\d.]+)", loaded)[1]) * 2**20),
           "bench_c1_tpot_ms": bench[1]["tpot_ms"]["median"], "bench_c32_output_tok_s": bench[32]["output_throughput"],
           "bench_c32_failed": bench[32]["failed"], "gauges_after": (out / "slots.txt").read_text().splitlines()[0]}
(out / "summary.json").write_text(json.dumps(summary, indent=1))
print(json.dumps(summary, indent=1))
PY
