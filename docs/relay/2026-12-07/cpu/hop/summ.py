"""Medians (and p90) of the client hop's parts, ms, from client.py's rows and the router's marks.
python docs/relay/2026-12-07/cpu/hop/summ.py CLIENT_ROWS ROUTER_MARKS..."""

import statistics
import sys

client = {p[0]: list(map(int, p[1:])) for p in (line.split() for line in open(sys.argv[1]))}
router = {}
for path in sys.argv[2:]:
    for line in open(path):
        p = line.split()
        router[p[0]] = list(map(int, p[1:]))
parts = {"send -> servicer starts": [], "servicer -> first delta yielded": [], "first delta's write": [],
         "yielded -> client has it": [], "client TTFT": []}
for rid, (sent, _accepted, first) in client.items():
    if rid not in router or not first:
        continue
    _, w0, w1, w2 = router[rid]
    for name, v in zip(parts, (w0 - sent, w1 - w0, w2 - w1, first - w1, first - sent), strict=True):
        parts[name].append(v / 1e6)
n = len(parts["client TTFT"])
print(f"{n} calls")
for name, xs in parts.items():
    xs.sort()
    print(f"{name:34s} p50 {statistics.median(xs):7.3f}  p90 {xs[int(0.9 * len(xs))]:7.3f}")
