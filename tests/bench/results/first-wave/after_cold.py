#!/usr/bin/env python3
"""Median over runs of each run's p90 TTFT for the requests sent after the cold start (the
live report's `p90 after the cold start`: sent at or after 2 s × the time scale, 1 s at the
default 0.5), pooled over the requests.csv files given, per router."""
import collections
import csv
import statistics
import sys

sys.path.insert(0, __file__.rsplit("/", 2)[0] + "/live-11-30b")
from paired import p90  # noqa: E402

COLD_START_S = 1.0
after = collections.defaultdict(list)
for path in sys.argv[1:]:
    for row in csv.DictReader(open(path)):
        if row["status"] == "200" and float(row["sent_s"]) >= COLD_START_S:
            after[(path, row["router"], row["run"])].append(float(row["ttft_ms"]))
for router in sorted({k[1] for k in after}):
    runs = [p90(v) for k, v in after.items() if k[1] == router]
    print(f"{router}: {len(runs)} runs, p90 after the cold start, median {statistics.median(runs):.1f} ms")
