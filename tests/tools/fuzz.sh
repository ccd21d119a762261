#!/usr/bin/env bash
# `make fuzz`: every libFuzzer target of tests/fuzz for FUZZ_SECONDS each (default 60),
# starting from the committed seeds; prints executions and crashes per target. A crash
# leaves its input in tests/fuzz/artifacts/<target>/ — turn it into a regression test.
# Needs the nightly toolchain and cargo-fuzz (installed here if missing).
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$root/tests/fuzz"
seconds="${FUZZ_SECONDS:-60}"
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked
rustup toolchain list | grep -q nightly || { echo "make fuzz needs a nightly toolchain (rustup toolchain install nightly)" >&2; exit 1; }
cargo +nightly fuzz build --fuzz-dir . >/dev/null
printf '| target | seconds | executions | crashes |\n|---|---|---|---|\n' >summary.md
status=0
for target in kv_events request_body scorer_api callout_response; do
  corpus="target/corpus/$target"
  mkdir -p "$corpus" && cp -n "seeds/$target"/* "$corpus"/ 2>/dev/null || true
  echo "fuzzing $target for ${seconds}s" >&2
  log="target/$target.log"
  if cargo +nightly fuzz run --fuzz-dir . "$target" "$corpus" -- -max_total_time="$seconds" >"$log" 2>&1; then crashes=0; else crashes=1; status=1; fi
  runs=$(grep -oE 'Done [0-9]+ runs' "$log" | grep -oE '[0-9]+' || echo "?")
  printf '| %s | %s | %s | %s |\n' "$target" "$seconds" "$runs" "$crashes" >>summary.md
done
cat summary.md
exit $status
