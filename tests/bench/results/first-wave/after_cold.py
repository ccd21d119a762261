#!/usr/bin/env python3
"""Median over runs of each run's p90 TTFT for the requests sent after the cold start (the
live report's `p90 after the cold start`: sent at or after 2 s × the time scale, 1 s at the
default 0.5), pooled over the requests.csv files given, per router."""
import pathlib
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "live-11-30b"))
from paired import COLD_START_S, p90, read_runs  # noqa: E402

after = {
    key: [float(r["ttft_ms"]) for r in rows if float(r["sent_s"]) >= COLD_START_S]
    for key, rows in read_runs(sys.argv[1:]).items()
}
for router in sorted({router for _, router, _ in after}):
    runs = [p90(ttfts) for (_, r, _), ttfts in after.items() if r == router and ttfts]
    print(f"{router}: {len(runs)} runs, p90 after the cold start, median {statistics.median(runs):.1f} ms")
