"""Per run of `kvgate-live-bench`, the TTFT p90 and how its chat sessions were spread.

    python3 tests/bench/results/live-11-30/chat_homes.py kvgate target/bench/live/requests.csv [...]

For every run of the named router in the given `requests.csv` files, one line, slowest
last: its TTFT p90, the most system prompts whose first turn one pod computed (their home),
how many pods were such a home, and the most chat requests (rows with a turn) one pod served.
"""

import collections
import csv
import sys


def main(router, paths):
    lines = []
    for path in paths:
        runs = collections.defaultdict(list)
        with open(path) as f:
            for r in csv.DictReader(f):
                if r["status"] == "200" and r["router"] == router:
                    runs[r["run"]].append(r)
        for rows in runs.values():
            rows.sort(key=lambda r: float(r["sent_s"]))
            ttfts = sorted(float(r["ttft_ms"]) for r in rows)
            p90 = ttfts[round((len(ttfts) - 1) * 0.9)]
            home = {}
            for r in rows:
                if r["turn"] == "0":
                    home.setdefault(r["prefix"], r["pod"])
            homes = collections.Counter(home.values())
            chats = collections.Counter(r["pod"] for r in rows if r["turn"] != "")
            lines.append((p90, max(homes.values()), len(homes), max(chats.values())))
    for p90, most, pods, chats in sorted(lines):
        print(f"p90 {p90:.0f} ms: at most {most} system prompts homed on a pod, {pods} pods a home, at most {chats} chat requests on a pod")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
