"""Where the light fleet's waiver made copies: reads the decision traces `throwaway.patch`
writes (`KV_TRACE=PREFIX`, one file per scorer process) and prints, over the decisions
where the fleet was light (the waiver's fleet-wide conditions, the home's crowd aside) and
the request went to a pod holding less than half what its home holds, the prefill queued
at the home and at the pod that took the copy.

    python3 tests/bench/results/idle-pods/copies.py TRACE [...]
"""

import sys

COLUMNS = ("light open prompt home_cached chosen_cached home_group home_inflight chosen_inflight "
           "home_queued chosen_queued fleet_inflight pods at_home home_recompute chosen_fill").split()


def quantiles(values, digits):
    values = sorted(values)
    if not values:
        return "-"
    at = lambda q: values[min(len(values) - 1, int(q * len(values)))]
    return " / ".join(f"{at(q):.{digits}f}" for q in (0.1, 0.5, 0.9))


for path in sys.argv[1:]:
    rows = [dict(zip(COLUMNS, map(float, line.split(",")))) for line in open(path)]
    light = [r for r in rows if r["open"] == 1]
    moved = [r for r in light if r["at_home"] == 0]
    copies = [r for r in moved if r["chosen_cached"] < 0.5 * r["home_cached"]]
    print(f"{path}: {len(rows)} decisions with a home, {len(light)} on a light fleet; "
          f"there {len(moved)} sent elsewhere than the home, {len(copies)} of them copies")
    for key, digits in (("home_queued", 0), ("chosen_queued", 0), ("prompt", 0), ("fleet_inflight", 0), ("chosen_fill", 2)):
        print(f"  copies' {key} (10th / 50th / 90th percentile): {quantiles([r[key] for r in copies], digits)}")
    print(f"  elsewhere, the chosen pod's prefill queued: {quantiles([r['chosen_queued'] for r in moved], 0)}")
