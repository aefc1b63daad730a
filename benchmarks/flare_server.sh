# Sourced by the H200 serving scripts (set $flare first): start `flare run` on port 8000 and wait
# for /health.  start_server CORE LOG [flare run flags...]
# sets $server (the server's pid) and $startup_s (seconds from start to healthy).
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
