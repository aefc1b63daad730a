#!/usr/bin/env bash
# Structured output on the H200, Qwen3-8B-shaped random core (the one h200_serving.sh exports):
# `flare bench` at concurrency 1 and 64 without and with a JSON-schema grammar
# (benchmarks/note_schema.json), side by side against one server, then the schema's compile time.
# The schema's body has a minLength beyond 256 tokens, so every constrained request runs to
# max_tokens as the unconstrained ones do (--ignore-eos): a request that ended early would let the
# next one in mid-run and mix prompt chunks into the decode steps, which measures another workload.
# The schema runs draw other prompts than the plain runs (--seed 1): prompts the server has seen
# would be restored from its prefix cache, and their decode steps would carry less prefill than the
# plain runs' do.
#   bash benchmarks/h200_structured.sh OUTDIR [extra `flare run` flags]
set -euo pipefail
out=${1:?usage: h200_structured.sh OUTDIR [flare run flags]}
shift
bash benchmarks/h200_serving.sh --prepare-only
work=/tmp/flare-bench
flare="python3 -m flare_core.cli --config $work/config.toml"
mkdir -p "$out"
source benchmarks/flare_server.sh
start_server "$(cat $work/qwen3-8b-random.core)" "$out/run.log" "$@"  # the bf16 core, by path
common="--dataset random --random-input-len 1024 --random-output-len 256 --ignore-eos"
for kind in plain schema; do
  grammar=(--seed 0); [ $kind = schema ] && grammar=(--seed 1 --json-schema benchmarks/note_schema.json)
  $flare bench $common --max-concurrency 1 --num-prompts 8 --num-warmups 1 "${grammar[@]}" \
    --result-file "$out/bench-c1-$kind.json" 2>&1 | grep -E "Successful|Output token|Median TTFT|Median TPOT|Total gen"
  $flare bench $common --max-concurrency 64 --num-prompts 256 "${grammar[@]}" \
    --result-file "$out/bench-c64-$kind.json" 2>&1 | grep -E "Successful|Output token|Median TTFT|Median TPOT|Total gen"
done
python3 benchmarks/grammar_compile.py --out "$out/compile.json"
kill -TERM $server; wait $server || true
tail -3 "$out/run.log"
