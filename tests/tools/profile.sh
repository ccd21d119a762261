#!/usr/bin/env bash
# make profile: where a request's CPU goes on the gateway path, reproducibly.
#
# 1. CPU time per request of each process (client, Envoy, scorer, pod), measured from
#    /proc schedstat by kvgate-overhead for Envoy round robin, the wasm filter, the native
#    module and the Endpoint Picker, short and 8k-token prompts and an 8k-token chat at 24 in
#    flight.
# 2. perf samples of Envoy + scorer on the wasm path, the native module's and the Endpoint
#    Picker's (h2c), one cell at a time: Envoy's CPU by thread and binary (Envoy's own code,
#    the wasm filter's JIT code in V8 or the native module, kernel, libc — Envoy ships
#    stripped, so no finer; the native module's own thread apart), the scorer's by stage of
#    a request (kvgate-profile-stages), and a flamegraph of both (inferno).
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
./target/release/kvgate-overhead --cells short@24,long@24,chat@24 --paths direct,rr,wasm,native,epp \
  --requests 2400 --rounds 12 | tee "$out/overhead.md"

for path in wasm native epp; do
for cell in short@24 long@24 chat@24; do
  name="$path-${cell%@*}"
  step "perf on the $path path, $cell"
  ./target/release/kvgate-overhead --cells "$cell" --paths "$path" --rounds 1 \
    --requests "${PROFILE_REQUESTS:-20000}" --perf "$out/$name.data" >/dev/null
  perf script -i "$out/$name.data" 2>/dev/null | "$tools/bin/inferno-collapse-perf" --all >"$out/$name.folded"
  "$tools/bin/inferno-flamegraph" --minwidth 0.2 --title "kvgate $path path, $cell: Envoy + scorer" \
    <"$out/$name.folded" >"$out/$name.svg"
  {
    echo "### $path path, $cell"
    echo
    echo '| Envoy thread: binary | share of Envoy CPU |'
    echo '|---|---|'
    # Envoy's worker thread's (and the native module's thread's) samples by binary, as shares
    # of theirs (perf's --comm filter miscounts threads renamed after start, so rows are
    # picked here).
    perf report -i "$out/$name.data" --no-children --sort comm,dso --stdio -g none 2>/dev/null |
      awk '$2 == "wrk:worker_0" || $2 == "kvgate-link" { pct = $1 + 0; dso = $3; if (dso == "[JIT]") dso = "[JIT] (the filter, V8)";
                                   dso = ($2 == "kvgate-link" ? "module thread: " : "worker: ") dso;
                                   share[dso] += pct; total += pct; order[++n] = dso }
           END { for (i = 1; i <= n; i++) if (!(order[i] in done)) { done[order[i]] = 1;
                   printf "| %s | %.1f %% |\n", order[i], 100 * share[order[i]] / total } }' | head -8
    echo
    ./target/release/kvgate-profile-stages <"$out/$name.folded"
    echo
  } | tee "$out/$name.md"
done
done
python3 tests/tools/profile_summary.py "$out" | tee "$out/summary.md"
step "results in $out/ (overhead.md, summary.md, {wasm,native,epp}-*.md, {wasm,native,epp}-*.svg)"
