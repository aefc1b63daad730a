#!/usr/bin/env bash
# Serving benchmarks on the H200 with a random-weight core: export, `flare run` start-up time with
# empty compile caches (cold), `flare bench` at concurrency 1 and 64, after which every request
# state row must be free again (/metrics), then the start-up of a second `flare run` of the same
# core, which finds the first one's compile caches (warm). At 64 also the decode-heavy random
# 128 / 1024. benchmarks/dense_summary.py gathers the figures into one results file.
#   bash benchmarks/h200_serving.sh [--moe|--qwen3.5] [--fp8] [--kv-fp8] OUTDIR [extra `flare run` flags, e.g. --no-compile]
#   bash benchmarks/h200_serving.sh [--moe|--qwen3.5] [--fp8] [--kv-fp8] --prepare-only   (checkpoint + export, no serving)
# The core: the Qwen3-8B shape; with --moe the MoE issue's 12-layer Qwen3-30B-A3B shape; with
# --qwen3.5 Qwen3.5's default dense text shape (a Gated DeltaNet hybrid) as Qwen publishes its
# checkpoints (benchmarks/random_qwen3_5.py), with an 8k context; with --fp8 exported from the same
# checkpoint with `--quantize fp8`, with --kv-fp8 with `--kv-dtype fp8_e4m3` (FP8 KV pages; all
# serve as the checkpoint's name).
set -euo pipefail
name=qwen3-8b-random; export_flags=""; write_checkpoint="benchmarks/random_checkpoint.py"; context=4096
if [ "${1:-}" = --moe ]; then write_checkpoint="benchmarks/random_checkpoint.py --moe"; name=qwen3-moe-12l-random; shift; fi
if [ "${1:-}" = --qwen3.5 ]; then write_checkpoint=benchmarks/random_qwen3_5.py; name=qwen3.5-random; context=8192; shift; fi
checkpoint=$name
if [ "${1:-}" = --fp8 ]; then export_flags="--quantize fp8"; name=$name-fp8; shift; fi
if [ "${1:-}" = --kv-fp8 ]; then export_flags="$export_flags --kv-dtype fp8_e4m3"; name=$name-kvfp8; shift; fi
out=${1:?usage: h200_serving.sh [--moe|--qwen3.5] [--fp8] [--kv-fp8] OUTDIR|--prepare-only [flare run flags]}
shift
work=/tmp/flare-bench; mkdir -p "$work"
source benchmarks/flare_server.sh
write_config "$work"
flare="python3 -m flare_core.cli --config $work/config.toml"
[ -d "$work/$checkpoint" ] || python3 $write_checkpoint "$work/$checkpoint"
# Both cores of a checkpoint serve under its name: the server is given the core's path (export's
# last line), kept in $name.core.
if [ ! -f "$work/$name.core" ]; then
  $flare export "$work/$checkpoint" $export_flags --no-progress --max-concurrency 64 --prefill-chunk-size 2048 \
    --context-length $context > "$work/$name.export.log" 2>&1 || { tail -20 "$work/$name.export.log"; exit 1; }
  tail -12 "$work/$name.export.log"
  tail -1 "$work/$name.export.log" > "$work/$name.core"
fi
core=$(cat "$work/$name.core")
[ "$out" = --prepare-only ] && exit 0
mkdir -p "$out"

start_server "$core" "$out/run-cold.log" "$@"
echo "startup_cold_s $startup_s" | tee "$out/startup-cold.txt"
$flare bench --dataset random --random-input-len 1024 --random-output-len 256 --ignore-eos --max-concurrency 1 \
  --num-prompts 8 --num-warmups 1 --result-file "$out/bench-c1.json" 2>&1 | tail -25
$flare bench --dataset random --random-input-len 1024 --random-output-len 256 --ignore-eos --max-concurrency 64 \
  --num-prompts 256 --result-file "$out/bench-c64.json" 2>&1 | tail -25
# Decode-heavy (the workload of vLLM's published Qwen3-8B H100 figure): short prompts, long answers.
$flare bench --dataset random --random-input-len 128 --random-output-len 1024 --ignore-eos --max-concurrency 64 \
  --num-prompts 256 --result-file "$out/bench-c64-decode-heavy.json" 2>&1 | tail -25
check_slots_free 64 "$out/slots.txt"
kill -TERM $server; wait $server || true
tail -5 "$out/run-cold.log"
start_server "$core" "$out/run-warm.log" "$@"
echo "startup_warm_s $startup_s" | tee "$out/startup-warm.txt"
kill -TERM $server; wait $server || true
