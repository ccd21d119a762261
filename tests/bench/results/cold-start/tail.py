"""What a live run's slowest requests were: reads the `requests.csv` of `kvgate-live-bench`.

    python3 tests/bench/results/cold-start/tail.py target/bench/live/requests.csv [cold_start_s]

Per router, over its runs: how many of each run's first requests (sent within 10 ms of its
start, all at once) computed their prompt whole; the requests at or over the run's TTFT p90
sent in the cold start (1 s by default: two simulated seconds at time scale 0.5) after those
first ones; and, after the cold start, the requests at or over that phase's TTFT p90. Each by
kind: a document question, a chat session's first turn or a later turn, served from cache
(at most 300 prompt tokens computed) or computed.
"""

import collections
import csv
import sys

COMPUTED = 300  # prompt tokens computed past which a request counts as computed


def main(path, cold_start):
    runs = collections.defaultdict(list)
    with open(path) as f:
        for r in csv.DictReader(f):
            if r["status"] == "200":
                runs[(r["router"], r["run"])].append(r)
    first_wave = collections.defaultdict(list)
    in_cold_start = collections.defaultdict(collections.Counter)
    slowest = collections.defaultdict(collections.Counter)
    for (router, _run), rows in runs.items():
        first = [r for r in rows if float(r["sent_s"]) < 0.01]
        first_wave[router].append(sum(computed(r) for r in first))
        p90 = p90_of(rows)
        for r in rows:
            if 0.01 <= float(r["sent_s"]) < cold_start and float(r["ttft_ms"]) >= p90:
                in_cold_start[router][kind(r)] += 1
        warm = [r for r in rows if float(r["sent_s"]) >= cold_start]
        if not warm:
            continue
        p90 = p90_of(warm)
        for r in warm:
            if float(r["ttft_ms"]) >= p90:
                slowest[router][kind(r)] += 1
    for router in first_wave:
        print(f"{router}: first requests computed whole, per run: {first_wave[router]}")
        print(f"  in the cold start after them, at or over the run's p90 (all runs): {kinds(in_cold_start[router])}")
        print(f"  after {cold_start} s, at or over the p90 (all runs): {kinds(slowest[router])}")


def p90_of(rows):
    ttfts = sorted(float(r["ttft_ms"]) for r in rows)
    return ttfts[round((len(ttfts) - 1) * 0.9)]


def kind(r):
    turn = "question" if r["turn"] == "" else ("first turn" if r["turn"] == "0" else "later turn")
    return (turn, "computed" if computed(r) else "cached")


def kinds(counts):
    return ", ".join(f"{k} {c}: {n}" for (k, c), n in sorted(counts.items()))


def computed(r):
    return int(r["prompt_tokens"]) - int(r["cached_tokens"]) > COMPUTED


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 1.0)
