"""How slow each router's slow requests are, by when they were sent: per run on average,
the requests over 30, 35, 40, 50, 70 and 100 ms TTFT in the first wave (sent in the first
20 ms), the rest of the cold start (to 1 s), the next second and after 2 s; and the first
wave's TTFT percentiles, by kind (questions or conversation turns) and whether the pod
found the prompt cached.

    python3 tests/bench/results/idle-pods/tails.py DIR/requests.csv [...]

A run's p90 is its 53rd slowest of 528 requests: past the first wave's 24, it is set by
how many of the rest are slow, and how slow.
"""

import collections
import csv
import sys

THRESHOLDS_MS = [30, 35, 40, 50, 70, 100]
PHASES = [("first wave", 0.02), ("cold start", 1.0), ("1-2 s", 2.0), ("after 2 s", float("inf"))]


def phase(sent_s):
    return next(name for name, end in PHASES if sent_s < end)


def main(paths):
    runs = collections.defaultdict(list)
    for path in paths:
        for row in csv.DictReader(open(path)):
            runs[(row["router"], path, row["run"])].append(row)
    routers = sorted({router for router, _, _ in runs})
    count = collections.Counter(router for router, _, _ in runs)
    over = collections.defaultdict(collections.Counter)
    wave = collections.defaultdict(list)
    for (router, _, _), rows in runs.items():
        for row in rows:
            sent, ttft = float(row["sent_s"]), float(row["ttft_ms"])
            for threshold in THRESHOLDS_MS:
                if ttft > threshold:
                    over[(router, phase(sent))][threshold] += 1
            if phase(sent) == "first wave":
                kind = "question" if row["turn"] == "" else "turn"
                cached = "cached" if int(row["cached_tokens"]) > 0 else "computed"
                wave[(router, kind, cached)].append(ttft)
    print("| router | phase | " + " | ".join(f"over {t} ms" for t in THRESHOLDS_MS) + " |")
    print("|---|---|" + "---|" * len(THRESHOLDS_MS))
    for router in routers:
        for name, _ in PHASES:
            c = over[(router, name)]
            cells = " | ".join(f"{c[t] / count[router]:.1f}" for t in THRESHOLDS_MS)
            print(f"| {router} | {name} | {cells} |")
    print()
    print("| router | first wave: kind | requests a run | TTFT p50 | p90 |")
    print("|---|---|---|---|---|")
    for (router, kind, cached), ttfts in sorted(wave.items()):
        ttfts.sort()
        n = len(ttfts)
        print(f"| {router} | {kind}, {cached} | {n / count[router]:.1f} | {ttfts[n // 2]:.0f} ms | {ttfts[int(n * 0.9)]:.0f} ms |")


if __name__ == "__main__":
    main(sys.argv[1:])
