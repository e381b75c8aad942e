"""Tokens of the overload phase that went to streams which then failed (cut off by their deadline),
from `bench_fairness.py --dump-requests` files: per file, all tokens received in the window, those
of failed streams and their share, each tenant's tokens of streams that did not fail, and the
outcomes of the requests that did not end `done` (`+acc`: after `accepted`).

    python docs/relay/2026-12-06c/waste.py /tmp/o/late_*.jsonl
"""

from __future__ import annotations

import collections
import json
import sys


def main(paths: list[str]) -> None:
    for path in paths:
        rows = [json.loads(line) for line in open(path)]
        tok: collections.Counter[tuple[str, str]] = collections.Counter()
        outcomes: collections.Counter[str] = collections.Counter()
        for r in rows:
            if r["phase"] != "d/overload":
                continue
            kind = r["outcome"] if r["outcome"] in ("done", "") else "fail"
            tok[(r["tenant"], kind)] += r["tokens"]
            if kind == "fail" and r["tenant"] != "probe-unknown-key":
                outcomes[r["outcome"].split("/")[-1] + ("+acc" if r["accepted"] else "")] += 1
        total = sum(tok.values())
        wasted = sum(v for (_, kind), v in tok.items() if kind == "fail")
        served = {t: sum(v for (tt, kind), v in tok.items() if tt == t and kind != "fail") for t in ("over1", "over2")}
        print(f"{path}: {total} tokens, {wasted} to failed streams ({100 * wasted / max(total, 1):.1f}%), "
              f"served {served}, not done {dict(outcomes)}")


if __name__ == "__main__":
    main(sys.argv[1:])
