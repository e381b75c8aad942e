"""p50 / p90 of each step between the marks sitecustomize.py writes (ms).  python summ.py MARKS..."""

import re
import sys

STEPS = [("call arrived -> validation", None, "gen0"), ("-> local tokenizer entered", "gen0", "lt0"),
         ("-> encode starts", "lt0", "enc0"), ("encode", "enc0", "enc1"), ("encode -> tokenized", "enc1", "tok"),
         ("tokenized -> id claim answered", "tok", "claim"), ("-> admitted", "claim", "adm"),
         ("admitted -> placement starts", "adm", "p0"), ("placement", "p0", "p1"),
         ("-> submit posted", "p1", "post"), ("submit posted -> first delta", "post", "first"),
         ("call arrived -> submit posted", None, "post"), ("call arrived -> first delta", None, "first")]


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
for name, a, b in STEPS:
    xs = [r[b] - (r[a] if a else 0.0) for r in rows if b in r and (a is None or a in r)]
    if xs:
        print(f"{name:32s} p50 {q(xs, .5):7.3f}  p90 {q(xs, .9):7.3f}")
