#!/usr/bin/env bash
# Lines of product code per crate (Rust outside `#[cfg(test)]` modules, inline or in a file of
# their own; blank and comment lines not counted), in this checkout or in DIR:
#   bash tests/tools/product_lines.sh [DIR]
set -euo pipefail
cd "${1:-$(dirname "$0")/../..}"
total=0
for crate in route-api/src filter/src filter/native/src filter/native/link/src scorer/src scorer/routing/src scorer/tokenize/src; do
  [ -d "$crate" ] || continue
  # A module declared `#[cfg(test)] mod name;` lives in name.rs or name/mod.rs beside its parent.
  test_files=$(find "$crate" -name '*.rs' | sort | xargs awk '
      prev ~ /^[[:space:]]*#\[cfg\(test\)\]/ && $0 ~ /^[[:space:]]*(pub )?mod [a-z_0-9]+;/ {
        name = $0; sub(/^[[:space:]]*(pub )?mod /, "", name); sub(/;.*/, "", name)
        dir = FILENAME; sub(/[^\/]*$/, "", dir)
        base = FILENAME; sub(/^.*\//, "", base); sub(/\.rs$/, "", base)
        if (base != "mod" && base != "lib" && base != "main") dir = dir base "/"
        print dir name ".rs"; print dir name "/mod.rs"
      }
      { prev = $0 }')
  n=$(find "$crate" -name '*.rs' | sort | grep -vxF -e "${test_files:-/none}" |
      xargs awk '
        # An inline `#[cfg(test)] mod name {` runs to the end of its file (where tests sit).
        FNR == 1 { skip = 0; attribute = 0 }
        attribute && /^[[:space:]]*(pub )?mod [a-z_0-9]+ *\{/ { skip = 1 }
        { attribute = /^[[:space:]]*#\[cfg\(test\)\]/ }
        !skip && !attribute && NF > 0 && $1 !~ /^\/\// { n++ } END { print n + 0 }')
  printf '%-24s %6d\n' "$crate" "$n"
  total=$((total + n))
done
printf '%-24s %6d\n' total "$total"
