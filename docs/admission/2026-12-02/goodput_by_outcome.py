"""Analysis helper of the 2026-12-02 device runs (docs/benchmarks.md): the tokens each phase of a
bench_fairness run delivered inside its window, by tenant and by how the request ended (from
`--dump-requests`).

    python docs/admission/2026-12-02/goodput_by_outcome.py requests.jsonl [window_seconds]
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict


def outcome(rec: dict[str, object]) -> str:
    if rec["outcome"] == "done":
        return "done"
    if rec["outcome"] == "":
        return "cut (by the bench)"
    return "failed-after-accepted" if rec["accepted"] else "refused"


def main(path: str, window: float) -> None:
    recs = [json.loads(line) for line in open(path)]
    for phase in sorted({r["phase"] for r in recs}):
        by: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
        for r in recs:
            if r["phase"] == phase:
                key = (r["tenant"], outcome(r))
                by[key][0] += 1
                by[key][1] += r["tokens"]
        print(f"== {phase}: in-window tokens/s by tenant, outcome")
        for (tenant, how), (n, tokens) in sorted(by.items()):
            print(f"  {tenant:8s} {how:24s} n={n:5d} tok/s={tokens / window:8.1f}")
        print(f"  all tokens {sum(t for _, t in by.values()) / window:.1f}/s")


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 8.0)
