"""Every pair of routers in live series, run by run: the median and mean of the difference
of their p90 TTFTs (first less second) over the runs both made, and in how many of those
runs the first was faster; then each router's median p90 and quartiles.

    python3 tests/bench/results/idle-pods/pairs.py DIR/requests.csv [...]
"""

import collections
import csv
import itertools
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "live-11-30b"))
from paired import p90  # noqa: E402

ttfts = collections.defaultdict(lambda: collections.defaultdict(list))
for path in sys.argv[1:]:
    with open(path) as f:
        for row in csv.DictReader(f):
            if row["status"] == "200":
                ttfts[row["router"]][(path, row["run"])].append(float(row["ttft_ms"]))
run_p90 = {router: {run: p90(v) for run, v in runs.items()} for router, runs in ttfts.items()}
for a, b in itertools.combinations(sorted(run_p90), 2):
    diffs = [run_p90[a][run] - run_p90[b][run] for run in run_p90[a] if run in run_p90[b]]
    faster = sum(d < 0 for d in diffs)
    print(f"{a} - {b}: median {statistics.median(diffs):.1f} ms, mean {statistics.mean(diffs):.1f} ms, "
          f"{a} faster in {faster} of {len(diffs)} runs")
for router, runs in sorted(run_p90.items()):
    v = sorted(runs.values())
    print(f"{router}: median p90 {statistics.median(v):.1f} ms, quartiles {v[len(v) // 4]:.1f} / {v[3 * len(v) // 4]:.1f}")
