"""Each router's TTFT over whole runs, beside the p90 the live benchmark reports: the median
over runs of each run's mean and p50 TTFT.

    python3 tests/bench/results/second-wave/means.py DIR/requests.csv [...]
"""

import collections
import csv
import statistics
import sys


def main(paths):
    runs = collections.defaultdict(list)
    for path in paths:
        for row in csv.DictReader(open(path)):
            runs[(row["router"], path, row["run"])].append(float(row["ttft_ms"]))
    print("| router | runs | mean TTFT (median over runs) | p50 TTFT (median over runs) |")
    print("|---|---|---|---|")
    for router in sorted({router for router, _, _ in runs}):
        ttfts = [sorted(v) for (r, _, _), v in runs.items() if r == router]
        means = statistics.median(statistics.mean(v) for v in ttfts)
        p50s = statistics.median(v[len(v) // 2] for v in ttfts)
        print(f"| {router} | {len(ttfts)} | {means:.1f} ms | {p50s:.1f} ms |")


if __name__ == "__main__":
    main(sys.argv[1:])
