"""Which phase sets a run's p90, in runs of `kvgate-live-bench` series.

    python3 tests/bench/results/move-history/p90_by_phase.py DIR/requests.csv [...]

Per router: over its runs, the correlation of each run's TTFT p90 with its count of slow
requests (over 30 ms) sent in each phase of `../live-11-30b/paired.py` (the cold start: after
the first wave of 24, within the first second; after 2 s).
"""

import collections
import pathlib
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "live-11-30b"))
from paired import SLOW_MS, p90, phase, read_runs  # noqa: E402


def main(paths):
    per_router = collections.defaultdict(list)
    for (_, router, _), rows in read_runs(paths).items():
        rows.sort(key=lambda r: float(r["sent_s"]))
        slow = collections.Counter(
            phase(i, float(r["sent_s"])) for i, r in enumerate(rows) if float(r["ttft_ms"]) > SLOW_MS
        )
        per_router[router].append((p90([float(r["ttft_ms"]) for r in rows]), slow["cold start"], slow["after 2 s"]))
    print("| router | runs | p90 against slow requests in the cold start | after 2 s |")
    print("|---|---|---|---|")
    for router, runs in sorted(per_router.items()):
        p, cold, late = zip(*runs)
        print(f"| {router} | {len(runs)} | {statistics.correlation(p, cold):.2f} | {statistics.correlation(p, late):.2f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
