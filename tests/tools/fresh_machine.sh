#!/usr/bin/env bash
# What the README's two commands cost on a fresh machine: a fresh clone of HEAD with empty
# caches (its own CARGO_HOME, KVGATE_CACHE, pip and npm caches), then `make demo`, then
# `make test`, each timed, with the bytes received over the network meanwhile (from
# /proc/net/dev, every interface but lo: run it on an otherwise idle machine).
# Not counted, as a fresh machine with rustup has them or they are system packages: the Rust
# toolchain, rustup's wasm32-wasip1 target and Debian's nats-server when already installed.
#
# Usage: tests/tools/fresh_machine.sh [WORKDIR [TARGET...]]   (make measure-fresh; WORKDIR is
# removed first; TARGETs default to `demo test`, `test` alone is what CI runs)
set -euo pipefail

root="$(cd "$(dirname "$0")/../.." && pwd)"
work="${1:-${TMPDIR:-/tmp}/kvgate-fresh}"
shift $(( $# > 0 ? 1 : 0 ))
targets=(demo test)
[ $# -eq 0 ] || targets=("$@")
step() { printf '\033[1m[fresh]\033[0m %s\n' "$*"; }

received() { awk 'NR > 2 && $1 != "lo:" { sum += $2 } END { printf "%.0f\n", sum }' /proc/net/dev; }
mib() { awk -v b="$1" 'BEGIN { printf "%.0f MiB", b / 1048576 }'; }

rm -rf "$work"
mkdir -p "$work"
step "cloning $(git -C "$root" rev-parse --short HEAD) into $work/kvgate"
git clone --quiet --no-hardlinks "$root" "$work/kvgate"
export CARGO_HOME="$work/cargo-home" KVGATE_CACHE="$work/kvgate-cache"
export PIP_CACHE_DIR="$work/pip-cache" npm_config_cache="$work/npm-cache"
unset CARGO_TARGET_DIR
# The toolchain stays rustup's; cargo's registry, git checkouts and installed tools start empty.
mkdir -p "$CARGO_HOME"

rows=()
for cmd in "${targets[@]}"; do
  step "make $cmd (output in $work/make-$cmd.log, each line after the seconds since its start)"
  before=$(received)
  start=$(date +%s)
  if ! make -C "$work/kvgate" "$cmd" 2>&1 | while IFS= read -r line; do
    printf '%5d %s\n' $((EPOCHSECONDS - start)) "$line"
  done >"$work/make-$cmd.log"; then
    tail -30 "$work/make-$cmd.log"
    echo "make $cmd failed: $work/make-$cmd.log" >&2
    exit 1
  fi
  seconds=$(( $(date +%s) - start ))
  rows+=("| \`make $cmd\` | $((seconds / 60)) min $((seconds % 60)) s | $(mib $(( $(received) - before ))) |")
done

echo
echo "fresh clone of $(git -C "$root" rev-parse --short HEAD), $(nproc) cores, $(date -u +%Y-%m-%d)"
echo
echo "| command (in this order) | wall time | received over the network |"
echo "|---|---|---|"
printf '%s\n' "${rows[@]}"
echo
echo "on disk afterwards: $(du -sh "$work/kvgate/target" | cut -f1) target/, $(du -sh "$work/kvgate/.kvgate" | cut -f1) .kvgate/, $(du -sh "$CARGO_HOME" | cut -f1) CARGO_HOME, $(du -sh "$KVGATE_CACHE" | cut -f1) KVGATE_CACHE"
