"""Where each router's cached requests waited, in runs of `kvgate-live-bench` series.

    python3 tests/bench/results/copy-turns/beside.py DIR/requests.csv [...]

Takes the requests the pod found cached (at most 500 tokens computed) that no request
computing more (a document or a session's history) overlapped on their pod, and sorts them
by what was beside them: how many requests computing 65–500 tokens (a session's new turn)
overlapped their wait on the pod, and how many requests the pod had in flight when they
were sent. Per router and group: requests per run, and their first-token time p50 / p90.
Within a group every router's requests answer alike (the gateway's path adds the same);
the groups each router fills differ.
"""

import collections
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "live-11-30b"))
from paired import computed, new_tokens, read_runs  # noqa: E402

IN_FLIGHT = ((0, 2), (3, 5), (6, 8), (9, None))


def main(paths):
    groups = collections.defaultdict(lambda: collections.defaultdict(list))
    runs = collections.Counter()
    for (_, router, _), rows in read_runs(paths).items():
        runs[router] += 1
        sent = [float(r["sent_s"]) for r in rows]
        first = [s + float(r["ttft_ms"]) / 1000 for s, r in zip(sent, rows)]
        end = [s + float(r["total_ms"]) / 1000 for s, r in zip(sent, rows)]
        for i, r in enumerate(rows):
            if computed(r):
                continue
            same_pod = [j for j, o in enumerate(rows) if j != i and o["pod"] == r["pod"]]
            beside = [rows[j] for j in same_pod if sent[j] < first[i] and first[j] > sent[i]]
            if any(computed(o) for o in beside):
                continue
            turns = min(sum(new_tokens(o) > 64 for o in beside), 2)
            in_flight = sum(sent[j] < sent[i] and end[j] > sent[i] for j in same_pod)
            band = next(k for k, (lo, hi) in enumerate(IN_FLIGHT) if hi is None or in_flight <= hi)
            groups[router][turns, band].append(float(r["ttft_ms"]))
    bands = [f"{lo}–{hi}" if hi is not None else f"{lo}+" for lo, hi in IN_FLIGHT]
    print("| turns computing beside | in flight on the pod | " + " | ".join(sorted(groups)) + " |")
    print("|---|---|" + "---|" * len(groups))
    for turns in range(3):
        for band, name in enumerate(bands):
            cells = []
            for router in sorted(groups):
                ttfts = sorted(groups[router][turns, band])
                n = len(ttfts)
                cells.append(
                    f"{n / runs[router]:.1f} a run, {ttfts[n // 2]:.1f} / {ttfts[9 * n // 10]:.1f}" if n else "–"
                )
            print(f"| {turns if turns < 2 else '2+'} | {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
