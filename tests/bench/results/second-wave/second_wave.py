"""Where each router's slow requests of the cold start come from: per run on average, by
phase (the first wave: sent in the first 20 ms; the rest of the cold start, to 1 s; the
next second; after 2 s), the requests whose pod computed their prefix (`new`: no request of
the run had computed it before; `copy`: one had, on some pod) and those it served from
cache, with how many of each were over 30 ms. Then, for every prefix computed in the cold
start: the requests sent to any pod while it computed (from its sending to its first
token); of those, the ones its own pod served from cache, and how many were over 30 ms; and
the cached requests of its pod sent before it and still waiting for their first token when
it was sent.

    python3 tests/bench/results/second-wave/second_wave.py DIR/requests.csv [...]
"""

import collections
import csv
import importlib.util
import pathlib
import sys

# The phases of the idle-pods record's tails.py, so that the two records' counts compare.
_tails = pathlib.Path(__file__).resolve().parent.parent / "idle-pods" / "tails.py"
_spec = importlib.util.spec_from_file_location("tails", _tails)
tails = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tails)
PHASES, phase = tails.PHASES, tails.phase

SLOW_MS = 30.0
# A request whose pod computed more of its prompt than this computed its prefix.
COMPUTED_TOKENS = 500


def main(paths):
    runs = collections.defaultdict(list)
    for path in paths:
        for row in csv.DictReader(open(path)):
            row["sent"] = float(row["sent_s"])
            row["ttft"] = float(row["ttft_ms"]) / 1000
            row["computed"] = int(row["cached_tokens"]) < COMPUTED_TOKENS
            runs[(row["router"], path, row["run"])].append(row)
    count = collections.Counter(router for router, _, _ in runs)
    kinds = collections.defaultdict(collections.Counter)
    met = collections.defaultdict(collections.Counter)
    for (router, _, _), rows in runs.items():
        rows.sort(key=lambda r: r["sent"])
        computed_before = set()
        for r in rows:
            p = phase(r["sent"])
            slow = r["ttft"] * 1000 > SLOW_MS
            if r["computed"]:
                kind = "copy" if r["prefix"] in computed_before else "new"
                computed_before.add(r["prefix"])
            else:
                kind = "cached"
            kinds[router][(p, kind)] += 1
            kinds[router][(p, kind + " slow")] += slow
            if p != "cold start" or not r["computed"]:
                continue
            m = met[router]
            m["computes"] += 1
            start, first_token = r["sent"], r["sent"] + r["ttft"]
            m["sent anywhere during"] += sum(1 for q in rows if q is not r and start <= q["sent"] <= first_token)
            for q in rows:
                if q is r or q["pod"] != r["pod"] or q["computed"]:
                    continue
                q_slow = q["ttft"] * 1000 > SLOW_MS
                if start <= q["sent"] <= first_token:
                    m["sent during"] += 1
                    m["sent during, slow"] += q_slow
                elif q["sent"] < start < q["sent"] + q["ttft"]:
                    m["waiting at its sending"] += 1
                    m["waiting at its sending, slow"] += q_slow
    print("| router | phase | computed new (slow) | computed copy (slow) | cached (slow) |")
    print("|---|---|---|---|---|")
    for router in sorted(kinds):
        k, n = kinds[router], count[router]
        for name, _ in PHASES:
            cells = " | ".join(
                f"{k[(name, kind)] / n:.1f} ({k[(name, kind + ' slow')] / n:.1f})" for kind in ("new", "copy", "cached")
            )
            print(f"| {router} | {name} | {cells} |")
    print()
    print(
        "| router | cold-start computes a run | requests sent to any pod while it computed | cached requests of its pod sent then (slow) | waiting there at its sending (slow) |"
    )
    print("|---|---|---|---|---|")
    for router in sorted(met):
        m = met[router]
        c = m["computes"]
        print(
            f"| {router} | {c / count[router]:.1f} | {m['sent anywhere during'] / c:.2f} | {m['sent during'] / c:.2f} ({m['sent during, slow'] / c:.2f}) "
            f"| {m['waiting at its sending'] / c:.2f} ({m['waiting at its sending, slow'] / c:.2f}) |"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
