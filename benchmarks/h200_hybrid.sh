#!/usr/bin/env bash
# Serving a Gated DeltaNet hybrid on the H200: a random-weight Qwen3.5 checkpoint of Transformers'
# default dense text shape as Qwen publishes them (benchmarks/random_qwen3_5.py), exported, served
# by `flare run`, `flare bench` at concurrency 1 and 64; after the load the server's request state
# rows must all be free again (/metrics: flare_slots_live 0, flare_slots_free = max concurrency).
#   bash benchmarks/h200_hybrid.sh OUTDIR [extra `flare run` flags]
#   bash benchmarks/h200_hybrid.sh --prepare-only   (checkpoint + export, no serving)
set -euo pipefail
out=${1:?usage: h200_hybrid.sh OUTDIR|--prepare-only [flare run flags]}
shift
work=/tmp/flare-bench; mkdir -p "$work"
printf '[paths]\ncore_cache = "%s/cores"\nhub_cache = "%s/hub"\nkeys = "%s/keys"\ntrust_store = "%s/trust.json"\n%s\n' \
  "$work" "$work" "$work" "$work" "compile_cache = \"$work/compiled\"" > "$work/config.toml"
flare="python3 -m flare_core.cli --config $work/config.toml"
name=qwen3.5-random
[ -d "$work/$name" ] || python3 benchmarks/random_qwen3_5.py "$work/$name"
if [ ! -f "$work/$name.core" ]; then
  $flare export "$work/$name" --no-progress --max-concurrency 64 --prefill-chunk-size 2048 \
    --context-length 8192 > "$work/$name.export.log" 2>&1 || { tail -20 "$work/$name.export.log"; exit 1; }
  tail -12 "$work/$name.export.log"
  tail -1 "$work/$name.export.log" > "$work/$name.core"
fi
core=$(cat "$work/$name.core")
[ "$out" = --prepare-only ] && exit 0
mkdir -p "$out"
cp "$work/$name.export.log" "$out/export.log"

source benchmarks/flare_server.sh
start_server "$core" "$out/run.log" "$@"
echo "startup_cold_s $startup_s" | tee "$out/startup.txt"
$flare bench --dataset random --random-input-len 1024 --random-output-len 256 --ignore-eos --max-concurrency 1 \
  --num-prompts 8 --num-warmups 1 --result-file "$out/bench-c1.json" 2>&1 | tail -25
$flare bench --dataset random --random-input-len 1024 --random-output-len 256 --ignore-eos --max-concurrency 64 \
  --num-prompts 256 --result-file "$out/bench-c64.json" 2>&1 | tail -25
python3 - "$out/slots.txt" <<'EOF'
import sys, urllib.request
text = urllib.request.urlopen("http://127.0.0.1:8000/metrics").read().decode()
gauges = {}
for line in text.splitlines():
    for gauge in ("flare_slots_live", "flare_slots_free", "flare_requests_waiting"):
        if line.startswith(gauge + " "):
            gauges[gauge] = float(line.split()[1])
open(sys.argv[1], "w").write(f"{gauges}\n")
print("after the load:", gauges)
if gauges.get("flare_slots_live") != 0 or gauges.get("flare_slots_free") != 64:
    sys.exit("state rows leaked: " + str(gauges))
EOF
kill -TERM $server; wait $server || true
tail -5 "$out/run.log"
