#!/usr/bin/env bash
# Serving A/B on one machine: h200_serving.sh for each source tree in turn (A B A B ...), so that
# two commits are compared side by side under the same conditions.
#   mkdir -p .ab/REV && git archive REV flare_core recipes-qwen recipes-deepseek recipes-kimi plugins benchmarks \
#     | tar -x -C .ab/REV                       (here; .ab/ is ignored by git: carry it, ~6 MB a tree)
#   bash benchmarks/h200_ab.sh OUTDIR ROUNDS .ab/REV1 .ab/REV2 ...    (on the GPU host)
# Each tree runs as its own code: from its own directory (Python puts the working directory first
# on sys.path for `python -m`), with its packages first on PYTHONPATH, and with the editable
# install's finder for flare_core switched off while it runs (restored on exit).
set -euo pipefail
out=${1:?usage: h200_ab.sh OUTDIR ROUNDS TREE...}; rounds=${2:?rounds}; shift 2
source benchmarks/flare_server.sh
tree_code_only
for round in $(seq 1 "$rounds"); do
  for tree in "$@"; do
    tree=$(cd "$tree" && pwd); name=$(basename "$tree")
    (cd "$tree" && export PYTHONPATH="$tree:$tree/recipes-qwen:$tree/recipes-deepseek:$tree/recipes-kimi:$tree/plugins/flare-recipe-llama${extra_path:+:$extra_path}" &&
     python3 -c "import flare_core, flare_recipe_qwen; assert flare_core.__file__.startswith('$tree'), flare_core.__file__; print('$name round $round:', flare_core.__file__)" &&
     { bash benchmarks/h200_serving.sh "$out/$name-$round" 2>&1 | grep -E "startup_|Output token|Median TTFT|Median TPOT" || true; })
  done
done
