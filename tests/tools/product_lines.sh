#!/usr/bin/env bash
# Lines of product code per crate (Rust outside `#[cfg(test)]` modules; blank and comment
# lines not counted), in this checkout or in DIR:  bash tests/tools/product_lines.sh [DIR]
set -euo pipefail
cd "${1:-$(dirname "$0")/../..}"
total=0
for crate in route-api/src filter/src filter/native/src filter/native/link/src scorer/src scorer/routing/src scorer/tokenize/src; do
  n=$(find "$crate" -name '*.rs' | sort | xargs awk 'FNR == 1 { skip = 0 } /^#\[cfg\(test\)\]/ { skip = 1 }
        !skip && NF > 0 && $1 !~ /^\/\// { n++ } END { print n + 0 }')
  printf '%-24s %6d\n' "$crate" "$n"
  total=$((total + n))
done
printf '%-24s %6d\n' total "$total"
