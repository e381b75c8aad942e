"""Each mark of sitecustomize.py here as p50 / p90 of its offset from the call's arrival (ms), in the order
of their medians (the order of the steps differs between trees), and the step from the previous one as the
median of per-request differences.  python docs/relay/2026-12-07/cpu/timeline/summ.py MARKS..."""

import re
import statistics
import sys


def q(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


rows = []
for path in sys.argv[1:]:
    for line in open(path):
        d = {k: float(v) for k, v in re.findall(r"(\w+)=([\d.]+)", line)}
        if "first" in d and "post" in d:
            rows.append(d)
print(f"{len(rows)} requests")
names = {k for r in rows for k in r}
order = sorted(names, key=lambda k: statistics.median(r[k] for r in rows if k in r))
prev = None
for name in order:
    xs = [r[name] for r in rows if name in r]
    step = [r[name] - r[prev] for r in rows if name in r and prev in r] if prev else xs
    print(f"{name:6s} at p50 {q(xs, .5):7.3f} p90 {q(xs, .9):7.3f}   "
          f"step from {prev or 'arrival':6s} p50 {q(step, .5):7.3f}")
    prev = name
