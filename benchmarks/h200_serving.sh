#!/usr/bin/env bash
# Serving benchmarks on the H200 with a random-weight core: export, `flare run` start-up time with
# empty compile caches (cold), `flare bench` at concurrency 1 and 64, then the start-up of a second
# `flare run` of the same core, which finds the first one's compile caches (warm).
#   bash benchmarks/h200_serving.sh [--moe] [--fp8] OUTDIR [extra `flare run` flags, e.g. --no-compile]
#   bash benchmarks/h200_serving.sh [--moe] [--fp8] --prepare-only   (checkpoint + export, no serving)
# The core: the Qwen3-8B shape, or with --moe the MoE issue's 12-layer Qwen3-30B-A3B shape; with
# --fp8 exported from the same checkpoint with `--quantize fp8`.
set -euo pipefail
moe=""; name=qwen3-8b-random; quantize=""
if [ "${1:-}" = --moe ]; then moe=--moe; name=qwen3-moe-12l-random; shift; fi
checkpoint=$name
if [ "${1:-}" = --fp8 ]; then quantize="--quantize fp8"; name=$name-fp8; shift; fi
out=${1:?usage: h200_serving.sh [--moe] OUTDIR|--prepare-only [flare run flags]}
shift
work=/tmp/flare-bench; mkdir -p "$work"
printf '[paths]\ncore_cache = "%s/cores"\nhub_cache = "%s/hub"\nkeys = "%s/keys"\ntrust_store = "%s/trust.json"\n%s\n' \
  "$work" "$work" "$work" "$work" "compile_cache = \"$work/compiled\"" > "$work/config.toml"
flare="python3 -m flare_core.cli --config $work/config.toml"
[ -d "$work/$checkpoint" ] || python3 benchmarks/random_checkpoint.py $moe "$work/$checkpoint"
# The served name is the checkpoint directory's: the FP8 core's is a link to the same checkpoint.
[ -e "$work/$name" ] || ln -s "$work/$checkpoint" "$work/$name"
if [ ! -f "$work/$name.exported" ]; then
  $flare export "$work/$name" $quantize --no-progress --max-concurrency 64 --prefill-chunk-size 2048 \
    --context-length 4096 2>&1 | tail -12
  touch "$work/$name.exported"
fi
[ "$out" = --prepare-only ] && exit 0
mkdir -p "$out"

source benchmarks/flare_server.sh
start_server "$name" "$out/run-cold.log" "$@"
echo "startup_cold_s $startup_s" | tee "$out/startup-cold.txt"
$flare bench --dataset random --random-input-len 1024 --random-output-len 256 --ignore-eos --max-concurrency 1 \
  --num-prompts 8 --num-warmups 1 --result-file "$out/bench-c1.json" 2>&1 | tail -25
$flare bench --dataset random --random-input-len 1024 --random-output-len 256 --ignore-eos --max-concurrency 64 \
  --num-prompts 256 --result-file "$out/bench-c64.json" 2>&1 | tail -25
kill -TERM $server; wait $server || true
tail -5 "$out/run-cold.log"
start_server "$name" "$out/run-warm.log" "$@"
echo "startup_warm_s $startup_s" | tee "$out/startup-warm.txt"
kill -TERM $server; wait $server || true
