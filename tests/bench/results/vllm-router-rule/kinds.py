"""Where each router's slow requests are, in runs of `kvgate-live-bench` series.

    python3 tests/bench/results/vllm-router-rule/kinds.py DIR/requests.csv [...]

Per router, per run on average: requests by when they were sent (the phases of
`../live-11-30b/paired.py`: the first wave of 24, the rest of the first second, the next
second, after 2 s), by kind (a document question, or a conversation's turn), by whether the
pod computed most of the prompt (over 500 tokens uncached: a copy) or found it cached, and
by whether their TTFT was over 30 ms. Then, of the conversations' turns sent after 2 s: over
how many pods each system prompt's turns were spread, and how many turns were sent to the
same pod within 5 ms of each (its burst), for the slow and the fast ones.
"""

import collections
import pathlib
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "live-11-30b"))
from paired import SLOW_MS, computed, phase, read_runs  # noqa: E402

PHASES = ["first wave", "cold start", "1-2 s", "after 2 s"]  # paired.phase's, in order


def main(paths):
    runs = read_runs(paths)
    counts = collections.defaultdict(collections.Counter)
    for (_, router, _), rows in runs.items():
        rows.sort(key=lambda r: float(r["sent_s"]))
        for i, r in enumerate(rows):
            kind = "turn" if r["turn"] else "question"
            slow = float(r["ttft_ms"]) > SLOW_MS
            counts[router][(phase(i, float(r["sent_s"])), kind, computed(r), slow)] += 1
    columns = [(k, c) for k in ("question", "turn") for c in (False, True)]
    head = " | ".join(f"{k}s {'computed' if c else 'cached'}: slow / fast" for k, c in columns)
    print(f"| router | phase | {head} |")
    print("|---|---|" + "---|" * len(columns))
    for router in sorted(counts):
        n = sum(1 for k in runs if k[1] == router)
        c = counts[router]
        for p in PHASES:
            cells = " | ".join(f"{c[(p, k, comp, True)] / n:.1f} / {c[(p, k, comp, False)] / n:.1f}" for k, comp in columns)
            print(f"| {router} | {p} | {cells} |")
    print()
    print("| router | after 2 s: pods per system prompt | turns sent with a slow one / a fast one |")
    print("|---|---|---|")
    for router in sorted(counts):
        spread, burst = [], {True: [], False: []}
        for (_, r_router, _), rows in runs.items():
            if r_router != router:
                continue
            late = [r for r in rows if r["turn"] and float(r["sent_s"]) >= 2.0]
            pods = collections.defaultdict(set)
            for r in late:
                pods[r["prefix"]].add(r["pod"])
                sent = float(r["sent_s"])
                together = sum(1 for x in late if x["pod"] == r["pod"] and abs(float(x["sent_s"]) - sent) <= 0.005)
                burst[float(r["ttft_ms"]) > SLOW_MS].append(together)
            spread.append(statistics.mean(len(p) for p in pods.values()))
        print(f"| {router} | {statistics.mean(spread):.2f} | {statistics.mean(burst[True]):.2f} / {statistics.mean(burst[False]):.2f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
