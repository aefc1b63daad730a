#!/usr/bin/env bash
# Mixed steps on and off (#47), side by side on one machine and one core: the Qwen3-8B shape, or
# with --moe the 12-layer Qwen3-30B-A3B shape (h200_serving.sh --prepare-only), then ROUNDS times
# in turn `flare run` as it is (mixed steps) and with --no-mixed-steps, each with `flare bench`
# random 1024 / 256 at concurrency 64 (256 prompts) from the installed tree (steady_run,
# flare_server.sh; extra `flare run` flags go to both).
#   bash benchmarks/mixed_ab.sh [--moe] OUTDIR ROUNDS [flare run flags...]
# Writes OUTDIR/{mixed,unmixed}-ROUND/bench-c64.json and slots.txt (steps by kind) and prints
# summary lines per run (output tok/s, TTFT and ITL p50 / p99, steps by kind).
set -euo pipefail
moe=""; [ "${1:-}" = --moe ] && { moe=--moe; shift; }
out=${1:?usage: mixed_ab.sh [--moe] OUTDIR ROUNDS [flare run flags...]}; rounds=${2:?rounds}; shift 2
bash benchmarks/h200_serving.sh $moe --prepare-only
name=$( [ -n "$moe" ] && echo qwen3-moe-12l-random || echo qwen3-8b-random )
work=/tmp/flare-bench
core=$(cat "$work/$name.core")
flare="python3 -m flare_core.cli --config $work/config.toml"
source benchmarks/flare_server.sh
for round in $(seq 1 "$rounds"); do
  steady_run "$out/mixed-$round" 64 "$core" "$@" || echo "mixed round $round: FAILED (see $out/mixed-$round)"
  steady_run "$out/unmixed-$round" 64 "$core" --no-mixed-steps "$@" || echo "unmixed round $round: FAILED"
done
