"""The engine hop step by step from sitecustomize.py's marks: p50 / p90 (ms) of each step, for requests
through the mesh (router marks) and for the engine alone's (engine marks only).
    python docs/relay/2026-12-07b/cpu/enginehop/summ.py <prefix>.*"""

import sys
from collections import defaultdict


def q(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else float("nan")


marks: dict[str, dict[str, float]] = defaultdict(dict)
for path in sys.argv[1:]:
    for line in open(path):
        name, rid, t = line.split()
        marks[rid].setdefault(name, float(t))

# (runs before the dsend mark was added have none: its two steps are then left out)
mesh = [m for m in marks.values() if {"arrival", "post", "out", "ein", "etok", "esend", "in", "first"} <= m.keys()]
alone = [m for m in marks.values() if "post" not in m and {"ein", "etok", "esend"} <= m.keys()]
steps = [("arrival", "post"), ("post", "out"), ("out", "ein"), ("ein", "etok"), ("etok", "esend"),
         ("esend", "in"), ("in", "dsend"), ("dsend", "first"), ("in", "first"), ("post", "first")]
print(f"mesh: {len(mesh)} requests")
for a, b in steps:
    xs = [(m[b] - m[a]) * 1e3 for m in mesh if a in m and b in m]
    if not xs:
        continue
    print(f"  {a:>7s} -> {b:6s} p50 {q(xs, .5):7.3f} p90 {q(xs, .9):7.3f}")
print(f"engine alone: {len(alone)} requests")
for a, b in steps[3:5]:  # ein -> etok, etok -> esend
    xs = [(m[b] - m[a]) * 1e3 for m in alone]
    print(f"  {a:>7s} -> {b:6s} p50 {q(xs, .5):7.3f} p90 {q(xs, .9):7.3f}")
