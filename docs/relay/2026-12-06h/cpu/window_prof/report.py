"""The window profile's report (docs/benchmarks.md, eighth session): time and calls per request by module and by
function.  python report.py PROFILE REQUESTS"""
import collections
import pstats
import sys

s = pstats.Stats(sys.argv[1])
n = int(sys.argv[2])


def short(f: str) -> str:
    return f.split("site-packages/")[-1].split("/work/main/")[-1].split("lib/python3.11/")[-1]


tt = sum(v[2] for v in s.stats.values())
calls = sum(v[1] for v in s.stats.values())
print(f"in the window: {tt / n * 1e3:.3f} ms per request (profiled), {calls / n:.0f} calls per request")
mods: collections.Counter[str] = collections.Counter()
for (f, _, _), v in s.stats.items():
    mods["~builtin" if f == "~" else short(f)] += v[2]
for k, v in mods.most_common(20):
    print(f"{v / n * 1e6:7.1f} us  {k}")
print()
rows = sorted(((v[2], v[1], f"{short(f)}:{line}:{name}") for (f, line, name), v in s.stats.items()), reverse=True)
for t, c, name in rows[:25]:
    print(f"{t / n * 1e6:7.1f} us {c / n:5.1f} calls  {name}")
