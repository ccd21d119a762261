"""What the cold start's cached document questions waited behind, in runs of
`kvgate-live-bench` series.

    python3 tests/bench/results/miss-charge-room/ahead.py DIR/requests.csv [...]

Per router: the document questions sent in the cold start (after the first wave of 24,
within the first second; `../live-11-30b/paired.py`'s phases) that the pod found cached
(at most 500 tokens computed), slow (first token over 30 ms) and fast, per run; and for each,
on average, how many requests sent earlier to the same pod were still awaiting their first
token when it was sent, how many of those computed over 500 tokens (and how many of these
were of its own document), and how many requests that pod had in flight.
"""

import collections
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "live-11-30b"))
from paired import SLOW_MS, computed, phase, read_runs  # noqa: E402


def main(paths):
    runs = read_runs(paths)
    stats = collections.defaultdict(collections.Counter)
    for (_, router, _), rows in runs.items():
        rows.sort(key=lambda r: float(r["sent_s"]))
        s = stats[router]
        s["runs"] += 1
        for i, r in enumerate(rows):
            sent = float(r["sent_s"])
            if phase(i, sent) != "cold start" or r["turn"] != "" or computed(r):
                continue
            before = [o for o in rows[:i] if o["pod"] == r["pod"]]
            ahead = [o for o in before if float(o["sent_s"]) + float(o["ttft_ms"]) / 1000 > sent]
            big = [o for o in ahead if computed(o)]
            k = "slow" if float(r["ttft_ms"]) > SLOW_MS else "fast"
            s[k] += 1
            s[k, "ahead"] += len(ahead)
            s[k, "big"] += len(big)
            s[k, "big, own document"] += sum(o["prefix"] == r["prefix"] for o in big)
            s[k, "in flight"] += sum(float(o["sent_s"]) + float(o["total_ms"]) / 1000 > sent for o in before)
    print(
        "| router | cached questions | per run | awaiting their first token ahead | of them computing"
        " (their own document's) | in flight on the pod |"
    )
    print("|---|---|---|---|---|---|")
    for router, s in sorted(stats.items()):
        for k in ("slow", "fast"):
            n = max(s[k], 1)
            print(
                f"| {router} | {k} | {s[k] / s['runs']:.1f} | {s[k, 'ahead'] / n:.2f} | {s[k, 'big'] / n:.2f}"
                f" ({s[k, 'big, own document'] / n:.2f}) | {s[k, 'in flight'] / n:.2f} |"
            )


if __name__ == "__main__":
    main(sys.argv[1:])
