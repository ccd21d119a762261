#!/usr/bin/env bash
# `make up` / `make down`: the local stack on its documented defaults, left running for
# manual use — Envoy 127.0.0.1:10000 (admin 127.0.0.1:9901), scorer 127.0.0.1:7070,
# simulated pods 127.0.0.1:8001-8004 with KV events on tcp://127.0.0.1:5557-5560.
# Configs: envoy/local/scorer.yaml and envoy/local/envoy.yaml. Logs and pids: .kvgate/run/.
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

wait_http() { # url
  for _ in $(seq 1 100); do
    curl -sf -o /dev/null "$1" && return 0
    sleep 0.1
  done
  echo "no answer from $1 (see $run/*.log)" >&2
  return 1
}

case "${1:-}" in
  up)
    mkdir -p "$run"
    if ls "$run"/*.pid >/dev/null 2>&1; then
      echo "the stack seems up already (.kvgate/run/*.pid); run 'make down' first" >&2
      exit 1
    fi
    for i in 1 2 3 4; do
      start "pod-$i" "$bin/kvgate-sim" --listen "127.0.0.1:800$i" --pod-id "pod-$i" \
        --kv-events-endpoint "tcp://127.0.0.1:$((5556 + i))" --kv-events-replay-endpoint "tcp://127.0.0.1:$((5566 + i))" \
        --tokenizer .kvgate/tokenizers/qwen3/tokenizer.json --time-scale "${KVGATE_TIME_SCALE:-1}"
    done
    for i in 1 2 3 4; do wait_http "http://127.0.0.1:800$i/health"; done
    start scorer "$bin/kvgate-scorer" --config envoy/local/scorer.yaml
    wait_http http://127.0.0.1:7070/healthz
    start envoy .kvgate/bin/envoy -c envoy/local/envoy.yaml --concurrency 2 -l warning
    wait_http http://127.0.0.1:9901/ready
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
    shopt -s nullglob
    for pid in "$run"/*.pid; do
      kill "$(cat "$pid")" 2>/dev/null || true
      rm -f "$pid"
    done
    echo "kvgate stack stopped"
    ;;
  *)
    echo "usage: $0 up|down" >&2
    exit 2
    ;;
esac
