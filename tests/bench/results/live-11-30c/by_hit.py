"""Where each router's slow requests are, by phase, kind and cache hit.

    python3 tests/bench/results/live-11-30c/by_hit.py DIR/requests.csv [...]

Per router and per run on average: requests, requests over 30 ms and mean TTFT, by
- phase, as `../live-11-30b/paired.py` counts it: the first wave (the first 24 sent), the
  rest of the cold start (sent in the first second), the next second, after 2 s;
- kind: a chat turn (prefixes 0-5, the system prompts) or a document question;
- hit, as the engine reported its cached tokens: `miss` (none), `part` (more than 200 of
  the prompt's tokens computed), `hit` (the rest).
"""

import collections
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "live-11-30b"))
from paired import SLOW_MS, phase, read_runs  # noqa: E402


def main(paths):
    runs = read_runs(paths)
    count = collections.Counter()
    stats = collections.defaultdict(collections.Counter)
    for (_, router, _), rows in runs.items():
        count[router] += 1
        rows.sort(key=lambda r: float(r["sent_s"]))
        for i, r in enumerate(rows):
            prompt, cached = int(r["prompt_tokens"]), int(r["cached_tokens"])
            hit = "miss" if cached == 0 else ("part" if cached < prompt - 200 else "hit")
            kind = "doc" if int(r["prefix"]) >= 6 else "chat"
            key = (phase(i, float(r["sent_s"])), kind, hit)
            ttft = float(r["ttft_ms"])
            stats[router][key + ("n",)] += 1
            stats[router][key + ("slow",)] += ttft > SLOW_MS
            stats[router][key + ("ms",)] += ttft
    routers = list(stats)
    print("| phase | kind | hit | " + " | ".join(f"{r}: per run / over 30 ms / mean ms" for r in routers) + " |")
    print("|---|---|---|" + "---|" * len(routers))
    order = {"first wave": 0, "cold start": 1, "1-2 s": 2, "after 2 s": 3}
    keys = sorted({k[:3] for s in stats.values() for k in s}, key=lambda k: (order[k[0]], k[1], k[2]))
    for key in keys:
        cells = []
        for r in routers:
            n = stats[r][key + ("n",)]
            cells.append(
                f"{n / count[r]:.1f} / {stats[r][key + ('slow',)] / count[r]:.1f} / {stats[r][key + ('ms',)] / max(n, 1):.0f}"
            )
        print(f"| {' | '.join(key)} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
