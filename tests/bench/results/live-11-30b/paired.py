"""Pools runs of `kvgate-live-bench` series: each router's p90 TTFT per run, and where its
slow requests were sent.

    python3 tests/bench/results/live-11-30b/paired.py DIR/requests.csv [...]

Per router: the runs pooled, the median and worst of their p90s, and how many of its runs
were slower than vllm-router's run of the same series and number (runs are interleaved, so
such a pair shared the machine's moment). Then, per run on average, the requests over
30 ms by when they were sent: the first wave (the first 24 sent), the rest of the cold start
(the first second), the next second, and after 2 s (only conversations' later turns are
left by then).
"""

import collections
import csv
import statistics
import sys

SLOW_MS = 30.0
# The cold start: requests sent in the first second (2 s simulated at the default time scale).
COLD_START_S = 1.0
# A request whose pod computed more of its prompt than this made a copy; less, it found the
# prompt cached.
COMPUTED_TOKENS = 500


def p90(ttfts):
    ttfts = sorted(ttfts)
    return ttfts[round((len(ttfts) - 1) * 0.9)]


def phase(index, sent_s):
    if index < 24:
        return "first wave"
    if sent_s < COLD_START_S:
        return "cold start"
    return "1-2 s" if sent_s < 2.0 else "after 2 s"


def new_tokens(row):
    """Prompt tokens the pod computed (not found cached)."""
    return int(row["prompt_tokens"]) - int(row["cached_tokens"])


def computed(row):
    """Whether the pod computed most of the request's prompt (`COMPUTED_TOKENS`)."""
    return new_tokens(row) > COMPUTED_TOKENS


def read_runs(paths):
    """The answered requests of each run: (path, router, run) -> rows."""
    runs = collections.defaultdict(list)
    for path in paths:
        with open(path) as f:
            for r in csv.DictReader(f):
                if r["status"] == "200":
                    runs[(path, r["router"], r["run"])].append(r)
    return runs


def main(paths):
    runs = read_runs(paths)
    p90s = {key: p90(float(r["ttft_ms"]) for r in rows) for key, rows in runs.items()}
    routers = sorted({router for _, router, _ in runs})
    phases = ["first wave", "cold start", "1-2 s", "after 2 s"]
    print(f"| router | runs | median p90 | worst | slower than vllm-router's run | over {SLOW_MS:.0f} ms per run: " + " / ".join(phases) + " |")
    print("|---|---|---|---|---|---|")
    for router in routers:
        keys = [k for k in runs if k[1] == router]
        values = [p90s[k] for k in keys]
        pairs = [(p90s[k], p90s.get((k[0], "vllm-router", k[2]))) for k in keys]
        pairs = [(a, b) for a, b in pairs if b is not None]
        slower = "—" if router == "vllm-router" else f"{sum(a > b for a, b in pairs)} of {len(pairs)}"
        slow = collections.Counter()
        for k in keys:
            rows = sorted(runs[k], key=lambda r: float(r["sent_s"]))
            for i, r in enumerate(rows):
                if float(r["ttft_ms"]) > SLOW_MS:
                    slow[phase(i, float(r["sent_s"]))] += 1
        per_run = " / ".join(f"{slow[p] / len(keys):.1f}" for p in phases)
        print(f"| {router} | {len(keys)} | {statistics.median(values):.1f} ms | {max(values):.0f} ms | {slower} | {per_run} |")


if __name__ == "__main__":
    main(sys.argv[1:])
