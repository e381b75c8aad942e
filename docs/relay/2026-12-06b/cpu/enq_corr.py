"""When each request's ENQUEUE reached Redis, against its spans (see enq_corr.sh): requests admitted
early (their queue_wait span started before their encode) only.

    python enq_corr.py RUN_DIR      # spans.jsonl and mon.txt (redis-cli monitor) in RUN_DIR
"""

import collections
import json
import re
import sys

ENQUEUE = re.compile(r'([\d.]+) \[\d+ [^\]]+\] "EVAL(?:SHA)?" "[^"]*" "1" "tq:\{default\}:meta" '
                     r'"[^"]*" "[^"]*" "[^"]*" "\d+" "(\d+)" "([^"]+)"')
NAMES = ["ENQUEUE at Redis - encode start", "encode", "admitted - encode end",
         "ENQUEUE at Redis - queue_wait start", "tokenize+admit"]


def main(run: str) -> None:
    traces = collections.defaultdict(list)
    with open(f"{run}/spans.jsonl") as f:
        for line in f:
            span = json.loads(line)
            traces[span["trace_id"]].append(span)
    at_redis: dict[str, float] = {}
    with open(f"{run}/mon.txt") as f:
        for line in f:
            m = ENQUEUE.match(line)
            if m and "~" in m.group(3):     # member = tenant:request_id~nonce
                at_redis.setdefault(m.group(3).split(":", 1)[1].split("~")[0], float(m.group(1)))
    rows = []
    for spans in traces.values():
        by = {s["name"]: s for s in spans}
        root, tok, enc, qw = (by.get(n) for n in ("tokenrelay.generate", "tokenize", "tokenizer.tokenize",
                                                   "queue_wait"))
        if not (root and tok and enc and qw):
            continue
        rid = root["attributes"].get("tokenrelay.request_id")
        if rid not in at_redis or qw["start"] > enc["start"]:   # not admitted early (estimate not warm yet)
            continue
        t = at_redis[rid] * 1e9
        rows.append(((t - enc["start"]) / 1e6, (enc["end"] - enc["start"]) / 1e6, (qw["end"] - enc["end"]) / 1e6,
                     (t - qw["start"]) / 1e6, (max(qw["end"], tok["end"]) - tok["start"]) / 1e6))
    print(len(rows), "requests admitted early; ms p50 / p90")
    for i, name in enumerate(NAMES):
        v = sorted(r[i] for r in rows)
        print(f"  {name:38s} {v[len(v) // 2]:7.3f} {v[int(0.9 * len(v))]:7.3f}")


if __name__ == "__main__":
    main(sys.argv[1])
