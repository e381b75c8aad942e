"""Where a refused request's time goes inside the router, from the spans the routers write.

Run `bench/bench_fairness.py --scenario d` with ``TOKENRELAY_TRACE_FILE=spans.jsonl`` (every
process appends its finished spans there: `services/tracing.py`), then:

    python bench/refusal_breakdown.py spans.jsonl [--slowest 0.02]

Per refused request (a router root span ``tokenrelay.generate`` with status ERROR and at least one
``queue_wait`` child, i.e. refused by admission, not by authentication):

  total        the root span: the call's arrival at the router to its end (the status handed to gRPC)
  ->enqueue    arrival to the first ENQUEUE's start (the handler, validation, the id claim's start)
  enqueue      the ENQUEUE round trips to Redis (`queue_wait` spans; two when a budget refusal on the
               estimated prompt was asked again with the real count)
  enqueue->end the last ENQUEUE's end to the root's end (waiting for Tokenize or the id claim, then
               raising the refusal)
  tokenize     the router's `tokenize` span (a budget refusal waits for it; a full queue does not)

Then the same for the slowest `--slowest` share of refusals, one line each, to tell a slow Redis
round trip from a slow Tokenize or a slow loop.
"""

from __future__ import annotations

import argparse
import sys

from ttft_breakdown import pct, traces_of  # this directory (run as a script or with it on sys.path)

PHASES = ("total", "->enqueue", "enqueue", "enqueue->end", "tokenize")


def refusals(path: str) -> list[dict[str, float]]:
    ms = 1e-6
    rows = []
    for spans in traces_of(path).values():
        root = next((s for s in spans if s["service"] == "router_svc" and s["name"] == "tokenrelay.generate"
                     and s.get("status") == "ERROR"), None)
        enq = [s for s in spans if s["service"] == "router_svc" and s["name"] == "queue_wait"]
        if root is None or not enq:
            continue
        tok = next((s for s in spans if s["service"] == "router_svc" and s["name"] == "tokenize"), None)
        rows.append({
            "total": (root["end"] - root["start"]) * ms,
            "->enqueue": (min(s["start"] for s in enq) - root["start"]) * ms,
            "enqueue": sum(s["end"] - s["start"] for s in enq) * ms,
            "enqueue->end": (root["end"] - max(s["end"] for s in enq)) * ms,
            "tokenize": (tok["end"] - tok["start"]) * ms if tok else float("nan"),
            "enqueues": float(len(enq)),
        })
    rows.sort(key=lambda r: r["total"])
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("spans")
    p.add_argument("--slowest", type=float, default=0.02, help="share of refusals listed one by one")
    args = p.parse_args(argv)
    rows = refusals(args.spans)
    if not rows:
        print("no refusal by admission in these spans", file=sys.stderr)
        return 1
    print(f"{len(rows)} refusals by admission; milliseconds")
    print(f"{'phase':<14}{'p50':>8}{'p90':>8}{'p99':>8}")
    for phase in PHASES:
        values = [r[phase] for r in rows if r[phase] == r[phase]]
        print(f"{phase:<14}{pct(values, .5):>8.2f}{pct(values, .9):>8.2f}{pct(values, .99):>8.2f}")
    slow = rows[-max(1, int(len(rows) * args.slowest)):]
    print(f"\nslowest {len(slow)}:")
    print("  " + "".join(f"{k:>14}" for k in (*PHASES, "enqueues")))
    for r in slow:
        print("  " + "".join(f"{r[k]:>14.2f}" for k in (*PHASES, "enqueues")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
