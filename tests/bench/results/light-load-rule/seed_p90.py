"""Per-seed p90 TTFT of the cluster simulator's per-request dumps (SIM_DUMP, throwaway.patch),
scored as kvgate-live-bench scores runs: the median over seeds of each seed's p90, with a
bootstrap 90 % interval of the paired difference against the first file.

usage: seed_p90.py BASE.csv OTHER.csv...
"""
import collections
import csv
import pathlib
import random
import statistics as st
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "live-11-30b"))
from paired import p90  # noqa: E402  (the live benchmark's p90)


def p90s(path):
    runs = collections.defaultdict(list)
    for r in csv.reader(open(path)):
        runs[int(r[0])].append((float(r[2]) - float(r[1])) * 1000)
    return {s: p90(v) for s, v in runs.items()}


base = p90s(sys.argv[1])
seeds = sorted(base)
rng = random.Random(1)
print(f"{sys.argv[1].split('/')[-1]}: median of {len(seeds)} seeds' p90 {st.median(base.values()):.1f} ms")
for path in sys.argv[2:]:
    other = p90s(path)
    diffs = []
    for _ in range(2000):
        pick = [rng.choice(seeds) for _ in seeds]
        diffs.append(st.median(other[s] for s in pick) - st.median(base[s] for s in pick))
    diffs.sort()
    print(f"{path.split('/')[-1]}: {st.median(other.values()):.1f} ms, difference {st.median(other.values()) - st.median(base.values()):+.1f} (90 % {diffs[100]:+.1f} to {diffs[1900]:+.1f})")
