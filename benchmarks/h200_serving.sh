#!/usr/bin/env bash
# Serving benchmarks on the H200 with a random-weight Qwen3-8B-shaped core:
# export, `flare run` start-up time, `flare bench` at concurrency 1 and 64.
#   bash benchmarks/h200_serving.sh OUTDIR [extra `flare run` flags, e.g. --no-compile]
#   bash benchmarks/h200_serving.sh --prepare-only   (checkpoint + export, no serving)
set -euo pipefail
out=${1:?usage: h200_serving.sh OUTDIR|--prepare-only [flare run flags]}
shift
work=/tmp/flare-bench; mkdir -p "$work"
printf '[paths]\ncore_cache = "%s/cores"\nhub_cache = "%s/hub"\nkeys = "%s/keys"\ntrust_store = "%s/trust.json"\n%s\n' \
  "$work" "$work" "$work" "$work" "compile_cache = \"$work/compiled\"" > "$work/config.toml"
flare="python3 -m flare_core.cli --config $work/config.toml"
[ -d "$work/qwen3-8b-random" ] || python3 benchmarks/random_checkpoint.py "$work/qwen3-8b-random"
if [ ! -f "$work/exported" ]; then
  $flare export "$work/qwen3-8b-random" --no-progress --max-concurrency 64 --prefill-chunk-size 2048 \
    --context-length 4096 2>&1 | tail -12
  touch "$work/exported"
fi
[ "$out" = --prepare-only ] && exit 0
mkdir -p "$out"
start=$(python3 -c 'import time; print(time.time())')
$flare run qwen3-8b-random --device cuda --port 8000 --no-dashboard "$@" > "$out/run.log" 2>&1 &
server=$!
until python3 -c 'import urllib.request; urllib.request.urlopen("http://127.0.0.1:8000/health")' 2>/dev/null; do
  kill -0 $server 2>/dev/null || { tail -30 "$out/run.log"; exit 1; }
  sleep 0.5
done
python3 -c "import time; print('startup_s', round(time.time() - $start, 1))" | tee "$out/startup.txt"
$flare bench --dataset random --random-input-len 1024 --random-output-len 256 --ignore-eos --max-concurrency 1 \
  --num-prompts 8 --num-warmups 1 --result-file "$out/bench-c1.json" 2>&1 | tail -25
$flare bench --dataset random --random-input-len 1024 --random-output-len 256 --ignore-eos --max-concurrency 64 \
  --num-prompts 256 --result-file "$out/bench-c64.json" 2>&1 | tail -25
kill -TERM $server; wait $server || true
tail -5 "$out/run.log"
