"""Where a routing run lost its cache hits, from `bench_routing.py --dump-requests` (one run per file):
per configuration, how many conversations were in progress on the replica a request was placed on
(a conversation is in progress from its first turn's placement to its last turn's), for new
conversations and for all requests, how many follow-ups changed replica, and the mean share of a
follow-up's prompt served from the cache. A replica of the evict trace holds about two of its
conversations: a new one placed beside two or more in progress there makes it thrash.

    python bench/bench_routing.py --traces evict --conversations 96 --configs prefix,sglang-cache_aware \
        --dump-requests run.jsonl
    python bench/routing_dump_report.py run.jsonl
"""

from __future__ import annotations

import collections
import json
import sys
from typing import Any


def report(rows: list[dict[str, Any]]) -> list[str]:
    out = []
    for config in sorted({r["config"] for r in rows}):
        reqs = sorted((r for r in rows if r["config"] == config and not r["error"]), key=lambda r: r["sent"])
        last_turn: dict[int, int] = collections.defaultdict(int)
        for r in reqs:
            last_turn[r["cid"]] = max(last_turn[r["cid"]], r["turn"])
        where: dict[int, int] = {}          # conversation in progress -> its replica
        beside_new: collections.Counter[int] = collections.Counter()
        beside_all: collections.Counter[int] = collections.Counter()
        hits: list[float] = []
        moved = 0
        for r in reqs:
            replica = r["replica"]
            beside = sum(1 for cid, at in where.items() if at == replica and cid != r["cid"])
            beside_all[beside] += 1
            if r["turn"] == 0:
                beside_new[beside] += 1
            else:
                hits.append(r["cached"] / max(1, r["prompt"]))
                moved += where.get(r["cid"]) != replica
            where[r["cid"]] = replica
            if r["turn"] == last_turn[r["cid"]]:
                where.pop(r["cid"], None)
        mean_hit = sum(hits) / len(hits) if hits else float("nan")
        out.append(f"{config}: new conversations placed beside N in progress {sorted(beside_new.items())}; "
                   f"all requests {sorted(beside_all.items())}; follow-ups moved {moved}; "
                   f"mean follow-up hit {mean_hit:.3f}")
    return out


def main(path: str) -> None:
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    print("\n".join(report(rows)))


if __name__ == "__main__":
    main(sys.argv[1])
