"""Medians of the first token's path from the timeline marks (docs/relay/2026-12-06f/cpu/timeline/), as
offsets from the call's arrival in ms, for runs where the submit may precede the grant (summ.py there
assumes the old order). Usage: python docs/relay/2026-12-06i/cpu/marks.py MARKS_FILE..."""

from __future__ import annotations

import statistics
import sys


def main(paths: list[str]) -> None:
    for path in paths:
        rows = []
        for line in open(path):
            parts = line.split()
            rows.append({k: float(v) for k, v in (p.split("=") for p in parts[1:])})
        rows = [r for r in rows if all(k in r for k in ("tok", "adm", "p0", "post", "first"))]

        def med(f, rows=rows):
            return statistics.median(f(r) for r in rows)
        print(f"{path}: {len(rows)} requests; tokenized {med(lambda r: r['tok']):.3f}, placement starts "
              f"+{med(lambda r: r['p0'] - r['tok']):.3f}, submit posted +{med(lambda r: r['post'] - r['tok']):.3f}, "
              f"admitted +{med(lambda r: r['adm'] - r['tok']):.3f} after it; "
              f"submit posted {med(lambda r: r['post']):.3f}, first token {med(lambda r: r['first']):.3f}")


if __name__ == "__main__":
    main(sys.argv[1:])
