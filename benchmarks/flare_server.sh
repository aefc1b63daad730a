# Sourced by the H200 serving scripts (set $flare first): start `flare run` on port 8000 and wait
# for /health.  start_server CORE LOG [flare run flags...]
# sets $server (the server's pid) and $startup_s (seconds from start to healthy).
# steady_run RUN "CONCURRENCIES" CORE [flare run flags...]: one steady-state run into directory RUN:
# start the server, `flare bench` random 1024 / 256 at each concurrency (8 prompts at c=1, else
# 256), the state rows all free again after the load (RUN/slots.txt), the server stopped, one
# summary line per concurrency (tok/s, TPOT, TTFT and ITL p50 / p99) and the steps by kind.
# tree_code_only: switch off the editable install's finder for flare_core until the script exits,
# so that each source tree of an A/B (h200_ab.sh, ab_steady.sh) runs as its own code from
# PYTHONPATH; sets $extra_path (the PYTHONPATH that was set before).
# check_slots_free ROWS OUT: after a load, the server's request state rows are all free again
# (/metrics: flare_slots_live 0, flare_slots_free ROWS, nothing waiting); the gauges go to OUT,
# with the steps the server ran so far and their tokens by kind (decode, prefill, mixed, restore).
# write_config WORK: WORK/config.toml keeping every path Flare writes (cores, hub, keys, trust
# store, compile cache) under WORK, apart from the user's own.
write_config() {
  printf '[paths]\ncore_cache = "%s/cores"\nhub_cache = "%s/hub"\nkeys = "%s/keys"\ntrust_store = "%s/trust.json"\ncompile_cache = "%s/compiled"\n' \
    "$1" "$1" "$1" "$1" "$1" > "$1/config.toml"
}

start_server() {
  local core=$1 log=$2 start
  shift 2
  start=$(python3 -c 'import time; print(time.time())')
  $flare run "$core" --device cuda --port 8000 --no-dashboard "$@" > "$log" 2>&1 &
  server=$!
  until python3 -c 'import urllib.request; urllib.request.urlopen("http://127.0.0.1:8000/health")' 2>/dev/null; do
    kill -0 $server 2>/dev/null || { tail -30 "$log"; exit 1; }
    sleep 0.5
  done
  startup_s=$(python3 -c "import time; print(round(time.time() - $start, 1))")
}

check_slots_free() {
  python3 - "$1" "$2" <<'EOF'
import sys, urllib.request
rows, out = int(sys.argv[1]), sys.argv[2]
text = urllib.request.urlopen("http://127.0.0.1:8000/metrics").read().decode()
gauges = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
          if line.split(" ")[0] in ("flare_slots_live", "flare_slots_free", "flare_requests_waiting")}
steps = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
         if line.startswith(("flare_steps_total", "flare_step_tokens_total"))}
open(out, "w").write(f"{gauges}\n{steps}\n")
print("after the load:", gauges, steps)
if gauges != {"flare_slots_live": 0, "flare_slots_free": rows, "flare_requests_waiting": 0}:
    sys.exit(f"request state rows not all free after the load: {gauges}")
EOF
}

tree_code_only() {
  local site
  site=$(python3 -c 'import site; print(site.getsitepackages()[0])')
  finders=$(ls "$site"/__editable__*flare_core*.pth 2>/dev/null || true)
  restore_finders() { for f in $finders; do [ -f "$f.off" ] && mv "$f.off" "$f"; done; return 0; }
  trap restore_finders EXIT
  for f in $finders; do mv "$f" "$f.off"; done
  extra_path=${PYTHONPATH:-}
}

steady_run() {
  local run=$1 concurrencies=$2 core=$3 c prompts
  shift 3
  mkdir -p "$run"
  start_server "$core" "$run/run.log" "$@"
  for c in $concurrencies; do
    prompts=$([ "$c" = 1 ] && echo 8 || echo 256)
    $flare bench --dataset random --random-input-len 1024 --random-output-len 256 --ignore-eos --max-concurrency "$c" \
      --num-prompts "$prompts" --num-warmups 1 --result-file "$run/bench-c$c.json" > "$run/bench-c$c.txt" 2>&1
  done
  check_slots_free 64 "$run/slots.txt" > /dev/null
  kill -TERM $server; wait $server || true
  python3 - "$run" "$concurrencies" <<'EOF'
import ast, json, sys
run, concurrencies = sys.argv[1], sys.argv[2].split()
steps = ast.literal_eval(open(f"{run}/slots.txt").read().splitlines()[1])
for c in concurrencies:
    m = json.load(open(f"{run}/bench-c{c}.json"))["metrics"]
    print(f"{run} c={c}: output {m['output_throughput']:.1f} tok/s, TPOT p50 {m['tpot_ms']['median']:.3f} ms, "
          f"TTFT p50 / p99 {m['ttft_ms']['median']:.1f} / {m['ttft_ms']['p99']:.1f} ms, ITL p50 / p99 "
          f"{m['itl_ms']['median']:.1f} / {m['itl_ms']['p99']:.1f} ms, failed {m['failed']}", flush=True)
print(f"{run} steps (whole run): " + ", ".join(f"{k} {v:g}" for k, v in steps.items()), flush=True)
EOF
}
