#!/usr/bin/env bash
# Builds an earlier commit of kvgate into DIR, to measure it beside this checkout in one run:
#   bash tests/tools/build_baseline.sh REV DIR
# DIR then holds kvgate-scorer, kvgate_filter.wasm and libkvgate_filter_native.so (for
# `kvgate-overhead --baseline DIR`) and routing-bench (the decision benchmark of
# `make bench-scorer`, run as `DIR/routing-bench --bench`). The commit is checked out in a git
# worktree under .kvgate/worktrees/ and built there (its own target directory).
set -euo pipefail
[ $# -eq 2 ] || { echo "usage: $0 REV DIR" >&2; exit 2; }
root="$(cd "$(dirname "$0")/../.." && pwd)"
rev="$(git -C "$root" rev-parse --short "$1")"
out="$(mkdir -p "$2" && cd "$2" && pwd)"
tree="$root/.kvgate/worktrees/$rev"
step() { printf '\033[1m[baseline]\033[0m %s\n' "$*"; }
if [ ! -d "$tree" ]; then
  step "worktree of $rev at $tree"
  git -C "$root" worktree add --detach "$tree" "$rev" >/dev/null
fi
cd "$tree"
step "building $rev (release): scorer, filters, decision benchmark"
cargo build --quiet --release -p kvgate-scorer --bin kvgate-scorer
cargo build --quiet --release -p kvgate-filter-native
cargo build --quiet --release -p kvgate-filter --target wasm32-wasip1
bench="$(cargo bench --quiet -p kvgate-routing --bench routing --no-run --message-format=json 2>/dev/null \
  | sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -1)"
cp target/release/kvgate-scorer target/release/libkvgate_filter_native.so \
   target/wasm32-wasip1/release/kvgate_filter.wasm "$out/"
cp "$bench" "$out/routing-bench"
step "$rev in $out"
