#!/usr/bin/env bash
# make profile: where a request's CPU goes on the gateway path, reproducibly.
#
# 1. CPU time per request of each process (client, Envoy, scorer, pod), measured from
#    /proc schedstat by kvgate-overhead for Envoy round robin, the wasm filter and the
#    Endpoint Picker, short and 8k-token prompts and an 8k-token chat at 24 in flight.
# 2. perf samples of Envoy + scorer on the wasm path (one cell at a time): Envoy's CPU by
#    binary (Envoy's own code, the wasm filter's JIT code in V8, kernel, libc — Envoy ships
#    stripped, so no finer), the scorer's by stage of a request (kvgate-profile-stages), and a
#    flamegraph of both (inferno).
#
# Results in target/profile/. Installs perf (Debian's linux-perf) and inferno (cargo, into
# .kvgate/tools) when missing. PROFILE_REQUESTS sets the sampled run's length.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$root"
out=target/profile
mkdir -p "$out"
step() { printf '\033[1m[profile]\033[0m %s\n' "$*"; }

if ! command -v perf >/dev/null; then
  step "apt-get install linux-perf"
  apt-get install -y -qq linux-perf >/dev/null
fi
tools="$root/.kvgate/tools"
if [ ! -x "$tools/bin/inferno-flamegraph" ]; then
  step "cargo install inferno (into $tools)"
  cargo install --quiet --locked --root "$tools" inferno --version 0.12.8
fi

step "CPU per request by process (kvgate-overhead)"
./target/release/kvgate-overhead --cells short@24,long@24,chat@24 --paths direct,rr,wasm,epp \
  --requests 2400 --rounds 12 | tee "$out/overhead.md"

for cell in short@24 long@24 chat@24; do
  name="wasm-${cell%@*}"
  step "perf on the wasm path, $cell"
  ./target/release/kvgate-overhead --cells "$cell" --paths wasm --rounds 1 \
    --requests "${PROFILE_REQUESTS:-6000}" --perf "$out/$name.data" >/dev/null
  perf script -i "$out/$name.data" 2>/dev/null | "$tools/bin/inferno-collapse-perf" --all >"$out/$name.folded"
  "$tools/bin/inferno-flamegraph" --minwidth 0.2 --title "kvgate wasm path, $cell: Envoy + scorer" \
    <"$out/$name.folded" >"$out/$name.svg"
  {
    echo "### $cell"
    echo
    echo '| Envoy binary | share of Envoy CPU |'
    echo '|---|---|'
    perf report -i "$out/$name.data" --no-children --percentage relative --sort dso --comm wrk:worker_0 --stdio -g none 2>/dev/null |
      awk '/^ +[0-9.]+%/ { printf "| %s | %s |\n", $2, $1 }' | head -6
    echo
    ./target/release/kvgate-profile-stages <"$out/$name.folded"
    echo
  } | tee "$out/$name.md"
done
step "results in $out/ (overhead.md, wasm-*.md, wasm-*.svg)"
