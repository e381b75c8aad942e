"""Per run of treeab.sh: the medians of the first token's path from the timeline marks, as offsets and steps
(ms), the requests whose placement waited for their session lookup (a `v1` mark: the stage's task placed
them) apart.   python docs/relay/2026-12-07/cpu/abpost.py OUT_DIR"""

import glob
import re
import statistics
import sys


def rows_of(d: str) -> list[dict[str, float]]:
    rows = []
    for f in glob.glob(d + "/tl.*"):
        for line in open(f):
            r = {k: float(v) for k, v in re.findall(r"(\w+)=([\d.]+)", line)}
            if "post" in r and "adm" in r:
                rows.append(r)
    return rows


def med(rows: list[dict[str, float]], f) -> float:
    return statistics.median(f(r) for r in rows) if rows else float("nan")


for d in sorted(glob.glob(sys.argv[1] + "/*/")):
    rows = rows_of(d)
    if not rows:
        continue
    waited = [r for r in rows if "v1" in r]
    name = d.rstrip("/").rsplit("/", 1)[1]
    print(f"{name:4s} {len(rows)} requests ({len(waited)} placed after their session lookup): "
          f"submit at {med(rows, lambda r: r['post']):.3f}, "
          f"admitted->submit {med(rows, lambda r: r['post'] - r['adm']):.3f}, "
          f"tokenized->submit {med(rows, lambda r: r['post'] - r['tok']):.3f}, "
          f"first delta at {med(rows, lambda r: r['first']):.3f}")
