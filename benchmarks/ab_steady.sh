#!/usr/bin/env bash
# Steady-state serving A/B on one machine: one random-weight core (h200_serving.sh --prepare-only:
# the Qwen3-8B shape, or with --moe the 12-layer Qwen3-30B-A3B shape), then for each source tree in
# turn, ROUNDS times: `flare run` of that core from the tree's own code, `flare bench` random
# 1024 / 256 at concurrency 1 (8 prompts) and 64 (256 prompts), the request state rows all free
# again after the load, the server stopped (steady_run, flare_server.sh). Start-up is not timed
# (h200_serving.sh does that).
#   mkdir -p .ab/REV && git archive REV flare_core recipes-qwen recipes-deepseek recipes-kimi plugins \
#     benchmarks | tar -x -C .ab/REV        (here; .ab/ stays out of git: carry it, ~6 MB a tree)
#   bash benchmarks/ab_steady.sh [--moe] OUTDIR ROUNDS TREE...     (on the GPU host, the project
#     installed editable: each tree runs with its packages first on PYTHONPATH and the editable
#     finder for flare_core switched off, as in h200_ab.sh)
# Prints summary lines per run and writes OUTDIR/NAME-ROUND/bench-c{1,64}.json and slots.txt.
set -euo pipefail
moe=""; [ "${1:-}" = --moe ] && { moe=--moe; shift; }
out=${1:?usage: ab_steady.sh [--moe] OUTDIR ROUNDS TREE...}; rounds=${2:?rounds}; shift 2
bash benchmarks/h200_serving.sh $moe --prepare-only
name=$( [ -n "$moe" ] && echo qwen3-moe-12l-random || echo qwen3-8b-random )
work=/tmp/flare-bench
core=$(cat "$work/$name.core")
source benchmarks/flare_server.sh
tree_code_only
for round in $(seq 1 "$rounds"); do
  for tree in "$@"; do
    tree=$(cd "$tree" && pwd); label=$(basename "$tree"); run="$out/$label-$round"; mkdir -p "$run"
    (cd "$tree" && export PYTHONPATH="$tree:$tree/recipes-qwen:$tree/recipes-deepseek:$tree/recipes-kimi:$tree/plugins/flare-recipe-llama${extra_path:+:$extra_path}" &&
     flare="python3 -m flare_core.cli --config $work/config.toml" &&
     python3 -c "import flare_core; assert flare_core.__file__.startswith('$tree'), flare_core.__file__" &&
     steady_run "$run" "1 64" "$core"
    ) || echo "$label round $round: FAILED (see $run)"
  done
done
