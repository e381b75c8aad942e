"""p50 / p90 of the steps the lean prototype (sitecustomize.py here) writes (ms).  python summ.py MARKS..."""

import re
import sys

rows = [{k: float(v) for k, v in re.findall(r"(\w+)=([\d.]+)", line)} for p in sys.argv[1:] for line in open(p)]


def q(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


print(f"{len(rows)} requests")
for name, a, b in (("call arrived -> tokenized", None, "tok"), ("tokenized -> granted", "tok", "adm"),
                   ("granted -> submit posted", "adm", "post"), ("call arrived -> submit posted", None, "post"),
                   ("submit posted -> first delta", "post", "first")):
    xs = [r[b] - (r[a] if a else 0.0) for r in rows]
    print(f"{name:32s} p50 {q(xs, .5):7.3f}  p90 {q(xs, .9):7.3f}")
