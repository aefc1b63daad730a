#!/usr/bin/env bash
# Sourced after benchmarks/gpu_site.sh on the GPU host: run groups of GPU tests, each in a process of
# its own, within DEADLINE seconds of the start (a group that would start with under 30 s left is
# skipped and says so), each group's output in $OUT/NAME.log and one line per group in
# $OUT/summary.log (benchmarks/dense_summary.py reads the logs' pytest summaries).
#   bash benchmarks/gpu_groups.sh DEADLINE "NAME|pytest args" ...
set -u
start=$(date +%s); deadline=$1; shift
for group in "$@"; do
  name=${group%%|*}; args=${group#*|}
  left=$(( deadline - ($(date +%s) - start) ))
  if [ $left -lt 30 ]; then echo "$name: skipped (no time left)" | tee -a "$OUT/summary.log"; continue; fi
  eval "FLARE_TEST_GPU=1 timeout $left python3 -m pytest -q -p no:randomly -rA $args" > "$OUT/$name.log" 2>&1
  echo "$name: rc=$? $(( $(date +%s) - start ))s $(tail -1 "$OUT/$name.log")" | tee -a "$OUT/summary.log"
done
