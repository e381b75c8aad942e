"""Analysis helper of the 2026-12-02 device runs (docs/benchmarks.md): where a refused request's
time went, from the spans of a traced bench_fairness run (TOKENRELAY_TRACE_FILE).

    python docs/admission/2026-12-02/refused_spans.py spans.jsonl
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from typing import Any


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * q))]


def main(path: str) -> None:
    traces: dict[str, dict[str, Any]] = defaultdict(dict)
    for line in open(path):
        span = json.loads(line)
        traces[span["trace_id"]].setdefault(span["name"], span)
    rows: dict[str, list[float]] = defaultdict(list)
    for spans in traces.values():
        root = spans.get("tokenrelay.generate")
        if not root or root["status"] != "ERROR" or "queue_wait" not in spans or "tokenize" not in spans:
            continue
        t0 = root["start"]
        tok, adm = spans["tokenize"], spans["queue_wait"]
        rows["total (root span)"].append((root["end"] - t0) / 1e6)
        rows["tokenize start"].append((tok["start"] - t0) / 1e6)
        rows["tokenize end"].append((tok["end"] - t0) / 1e6)
        if "tokenizer.tokenize" in spans:
            rows["tokenizer server start"].append((spans["tokenizer.tokenize"]["start"] - t0) / 1e6)
        rows["enqueue start"].append((adm["start"] - t0) / 1e6)
        rows["enqueue end"].append((adm["end"] - t0) / 1e6)
        rows["after both ends"].append((root["end"] - max(tok["end"], adm["end"])) / 1e6)
    print("refused requests, ms from the call's arrival at the router")
    for name, values in rows.items():
        print(f"{name:24s} n={len(values):5d} p50={pct(values, .5):7.2f} p90={pct(values, .9):7.2f} "
              f"p99={pct(values, .99):7.2f} max={max(values):8.2f}")


if __name__ == "__main__":
    main(sys.argv[1])
