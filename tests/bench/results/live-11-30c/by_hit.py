"""Where each router's slow requests are, by phase, kind and cache hit.

    python3 tests/bench/results/live-11-30c/by_hit.py DIR/requests.csv [...]

Per router and per run on average: requests, requests over 30 ms and mean TTFT, by
- phase: the first wave (the first 24 sent), the rest of the cold start (sent in the first
  second), the next second, after 2 s;
- kind: a chat turn (prefixes 0-5, the system prompts) or a document question;
- hit, as the engine reported its cached tokens: `miss` (none), `part` (more than 200 of
  the prompt's tokens computed), `hit` (the rest).
"""

import collections
import csv
import sys

SLOW_MS = 30.0


def phase(index, sent_s):
    if index < 24:
        return "wave"
    if sent_s < 1.0:
        return "cold"
    return "1-2 s" if sent_s < 2.0 else "late"


def main(paths):
    runs = collections.defaultdict(list)
    for path in paths:
        for r in csv.DictReader(open(path)):
            runs[(r["router"], path, r["run"])].append(r)
    count = collections.Counter()
    stats = collections.defaultdict(collections.Counter)
    for (router, _, _), rows in runs.items():
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
    order = {"wave": 0, "cold": 1, "1-2 s": 2, "late": 3}
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
