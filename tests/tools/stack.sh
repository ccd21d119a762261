#!/usr/bin/env bash
# `make up` / `make down`: the local stack on its documented defaults, left running for
# manual use — Envoy 127.0.0.1:10000 (admin 127.0.0.1:9901), scorer 127.0.0.1:7070,
# simulated pods 127.0.0.1:8001-8004 with KV events on tcp://127.0.0.1:5557-5560.
# Configs: envoy/local/scorer.yaml and envoy/local/envoy.yaml. Logs and pids: .kvgate/run/.
# `up` refuses while a stack runs or another process holds one of its ports; `down` returns
# once every process has exited (the scorer drains for 5 s first).
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
run="$root/.kvgate/run"
bin="${CARGO_TARGET_DIR:-$root/target}/release"
cd "$root"

start() { # name, command...
  local name=$1; shift
  # Detached: its own session, no stdin, and re-parented at once (the subshell exits right
  # away). Envoy asks for SIGTERM when its parent dies, so it must not be this script's child.
  (setsid sh -c 'echo $$ >"$0"; exec "$@"' "$run/$name.pid" "$@" >"$run/$name.log" 2>&1 </dev/null &)
}

# The stack's ports: Envoy and its admin, the scorer, the pods, their KV events and replay.
ports=(10000 9901 7070 8001 8002 8003 8004 5557 5558 5559 5560 5567 5568 5569 5570)

alive() { # pid
  kill -0 "$1" 2>/dev/null
}

listening() { # port
  (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

wait_http() { # name, url: until it answers, while the process named lives
  local pid=""
  for _ in $(seq 1 100); do
    curl -sf -o /dev/null "$2" && return 0
    # Its pid file comes from its own shell, a moment after the start.
    [ -n "$pid" ] || pid=$(cat "$run/$1.pid" 2>/dev/null || true)
    if [ -n "$pid" ] && ! alive "$pid"; then
      echo "$1 exited while starting; the end of $run/$1.log:" >&2
      tail -n 20 "$run/$1.log" >&2
      return 1
    fi
    sleep 0.1
  done
  echo "no answer from $2 (see $run/$1.log)" >&2
  return 1
}

stop() { # every process of the stack: SIGTERM, then wait until each has exited
  shopt -s nullglob
  local pids=() pidfile pid
  for pidfile in "$run"/*.pid; do
    pid=$(cat "$pidfile")
    if alive "$pid"; then
      kill "$pid" 2>/dev/null || true
      pids+=("$pid")
    fi
  done
  # The scorer drains its connections first (5 s).
  for _ in $(seq 1 300); do
    local left=()
    for pid in "${pids[@]}"; do alive "$pid" && left+=("$pid"); done
    pids=("${left[@]}")
    [ ${#pids[@]} -eq 0 ] && break
    sleep 0.1
  done
  if [ ${#pids[@]} -gt 0 ]; then
    echo "still running after 30 s, killed: ${pids[*]}" >&2
    kill -KILL "${pids[@]}" 2>/dev/null || true
  fi
  rm -f "$run"/*.pid
}

case "${1:-}" in
  up)
    mkdir -p "$run"
    shopt -s nullglob
    for pidfile in "$run"/*.pid; do
      if alive "$(cat "$pidfile")"; then
        echo "the stack is up already ($(basename "$pidfile" .pid) runs); run 'make down' first" >&2
        exit 1
      fi
      rm -f "$pidfile" # left by a stack that died
    done
    busy=()
    for port in "${ports[@]}"; do listening "$port" && busy+=("$port"); done
    if [ ${#busy[@]} -gt 0 ]; then
      echo "ports in use by something else: ${busy[*]} (another stack, started otherwise?); stop it first" >&2
      exit 1
    fi
    # A stack that fails to start is not left half up.
    trap 'stop' ERR
    for i in 1 2 3 4; do
      start "pod-$i" "$bin/kvgate-sim" --listen "127.0.0.1:800$i" --pod-id "pod-$i" \
        --kv-events-endpoint "tcp://127.0.0.1:$((5556 + i))" --kv-events-replay-endpoint "tcp://127.0.0.1:$((5566 + i))" \
        --tokenizer .kvgate/tokenizers/qwen3/tokenizer.json --time-scale "${KVGATE_TIME_SCALE:-1}"
    done
    for i in 1 2 3 4; do wait_http "pod-$i" "http://127.0.0.1:800$i/health"; done
    start scorer "$bin/kvgate-scorer" --config envoy/local/scorer.yaml
    wait_http scorer http://127.0.0.1:7070/healthz
    start envoy .kvgate/bin/envoy -c envoy/local/envoy.yaml --concurrency 2 -l warning
    wait_http envoy http://127.0.0.1:9901/ready
    trap - ERR
    cat <<MSG
kvgate is up:
  Envoy      http://127.0.0.1:10000   (admin http://127.0.0.1:9901)
  scorer     http://127.0.0.1:7070    (GET /v1/pods, /metrics)
  pods       http://127.0.0.1:8001-8004, KV events tcp://127.0.0.1:5557-5560
  logs       .kvgate/run/*.log
try:  curl -s localhost:10000/v1/chat/completions -d '{"messages":[{"role":"user","content":"Hello"}],"max_tokens":8}'
stop: make down
MSG
    ;;
  down)
    stop
    echo "kvgate stack stopped"
    ;;
  *)
    echo "usage: $0 up|down" >&2
    exit 2
    ;;
esac
