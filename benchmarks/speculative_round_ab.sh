#!/usr/bin/env bash
# speculative_round.py side by side: one random-weight core of the Qwen3-8B shape (exported for
# rounds: 16 rows, 256-token chunks, a 4k context), then for each source tree in turn the rounds
# and decode steps timed by that tree's own code (as ab_steady.sh runs trees).
#   mkdir -p .ab/REV && git archive REV flare_core recipes-qwen recipes-deepseek recipes-kimi plugins \
#     benchmarks | tar -x -C .ab/REV        (here; .ab/ stays out of git: carry it, ~6 MB a tree)
#   bash benchmarks/speculative_round_ab.sh OUTDIR TREE... [-- speculative_round.py flags]
# Writes OUTDIR/NAME.json (NAME: the tree's folder name) and prints each tree's rows.
set -euo pipefail
out=${1:?usage: speculative_round_ab.sh OUTDIR TREE... [-- FLAGS]}; shift
trees=(); while [ $# -gt 0 ] && [ "$1" != -- ]; do trees+=("$(cd "$1" && pwd)"); shift; done
[ "${1:-}" = -- ] && shift
mkdir -p "$out"; out=$(cd "$out" && pwd)
work=/tmp/flare-bench; mkdir -p "$work"
source benchmarks/flare_server.sh
write_config "$work"
checkpoint=$work/qwen3-8b-random
[ -d "$checkpoint" ] || python3 benchmarks/random_checkpoint.py "$checkpoint"
if [ ! -f "$work/rounds.core" ]; then
  python3 -m flare_core.cli --config "$work/config.toml" export "$checkpoint" --no-progress --max-concurrency 16 \
    --prefill-chunk-size 256 --context-length 4096 > "$work/rounds.export.log" 2>&1 \
    || { tail -20 "$work/rounds.export.log"; exit 1; }
  tail -1 "$work/rounds.export.log" > "$work/rounds.core"
fi
tree_code_only
for tree in "${trees[@]}"; do
  (cd "$tree" && export PYTHONPATH="$tree:$tree/recipes-qwen:$tree/recipes-deepseek:$tree/recipes-kimi:$tree/plugins/flare-recipe-llama${extra_path:+:$extra_path}" &&
   python3 -c "import flare_core; assert flare_core.__file__.startswith('$tree'), flare_core.__file__" &&
   python3 benchmarks/speculative_round.py --config "$work/config.toml" --core "$(cat "$work/rounds.core")" "$@" \
     --out "$out/$(basename "$tree").json") || echo "$(basename "$tree"): FAILED"
done
