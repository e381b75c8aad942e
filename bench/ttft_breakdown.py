"""Where a mesh request's time to first token goes, from the spans every service writes.

Run the mesh with ``TOKENRELAY_TRACE_FILE=spans.jsonl`` (every service appends its finished spans
there: `services/tracing.py`), drive it (e.g. ``tokenrelay bench --workload chat-multiturn``), then:

    python bench/ttft_breakdown.py spans.jsonl [--json out.json]

Per request (one trace), the router's root span ``tokenrelay.generate`` starts when the call arrived
and carries a ``first_delta`` event (the first client delta handed to gRPC); the phases between are
the router's child spans and the other services' server spans of the same trace:

  arrive->tokenize   the handler: auth, validation, the id claim's start
  tokenize           the Tokenize call as the router sees it; of which `tokenizer` is the server's span
  ->admit            tokenize end to the admission call (negative: admission started while tokenizing,
                     `--admit-while-tokenizing`)
  admit              the admission round trip (queue_wait span; queueing included when queued)
  tokenize+admit     tokenize start to the later of the two ends: what the request waited for both
  ->route            the later of tokenize and admission to the placement decision (Accepted,
                     detokenizer session, engine task)
  route              the placement decision
  ->engine           route end to the engine's span start (the submit over the multiplexed stream)
  engine prefill     the engine's span start to its first_token event
  ->router           the engine's first token to the router's prefill span end (the return hop)
  detok+write        the router's first token to the first client delta (the Detokenize round trip),
                     split at the tokenizer's first_tokens event into ->tokenizer and tokenizer->delta

Clocks: all services on one host share the wall clock the spans use. Percentiles are over requests;
the phases' p50s do not add up to the total's p50.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from typing import Any

PHASES = ("arrive->tokenize", "tokenize", "(tokenizer server)", "->admit", "admit", "tokenize+admit", "->route",
          "route",
          "->engine", "engine prefill", "->router", "detok+write", "(->tokenizer)", "(tokenizer->delta)",
          "router TTFT", "mesh part (TTFT - prefill)")


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))] if s else float("nan")


def _event(span: dict[str, Any], name: str) -> int | None:
    return next((e["t"] for e in span.get("events", []) if e["name"] == name), None)


def traces_of(path: str) -> dict[str, list[dict[str, Any]]]:
    """The spans of a TOKENRELAY_TRACE_FILE, grouped by trace (one request each)."""
    traces: dict[str, list[dict[str, Any]]] = defaultdict(list)
    with open(path) as f:
        for line in f:
            if line.strip():
                span = json.loads(line)
                traces[span["trace_id"]].append(span)
    return traces


def breakdown(path: str) -> dict[str, list[float]]:
    traces = traces_of(path)
    out: dict[str, list[float]] = defaultdict(list)
    for spans in traces.values():
        by = {(s["service"], s["name"]): s for s in spans}
        root = by.get(("router_svc", "tokenrelay.generate"))
        first = _event(root, "first_delta") if root else None
        need = [("router_svc", n) for n in ("tokenize", "queue_wait", "route", "prefill")] + [
            ("engine_svc", "engine.generate")]
        if root is None or first is None or any(k not in by for k in need):
            continue
        tok, adm, route, pre = (by[("router_svc", n)] for n in ("tokenize", "queue_wait", "route", "prefill"))
        eng = by[("engine_svc", "engine.generate")]
        eng_first = _event(eng, "first_token")
        if eng_first is None:
            continue
        ms = 1e-6
        out["arrive->tokenize"].append((tok["start"] - root["start"]) * ms)
        out["tokenize"].append((tok["end"] - tok["start"]) * ms)
        srv = by.get(("tokenizer_svc", "tokenizer.tokenize"))
        if srv:
            out["(tokenizer server)"].append((srv["end"] - srv["start"]) * ms)
        out["->admit"].append((adm["start"] - tok["end"]) * ms)
        out["admit"].append((adm["end"] - adm["start"]) * ms)
        both = max(adm["end"], tok["end"])
        out["tokenize+admit"].append((both - tok["start"]) * ms)
        out["->route"].append((route["start"] - both) * ms)
        out["route"].append((route["end"] - route["start"]) * ms)
        out["->engine"].append((eng["start"] - route["end"]) * ms)
        out["engine prefill"].append((eng_first - eng["start"]) * ms)
        out["->router"].append((pre["end"] - eng_first) * ms)
        out["detok+write"].append((first - pre["end"]) * ms)
        detok = by.get(("tokenizer_svc", "tokenizer.detokenize"))
        applied = _event(detok, "first_tokens") if detok else None
        if applied is not None:
            out["(->tokenizer)"].append((applied - pre["end"]) * ms)
            out["(tokenizer->delta)"].append((first - applied) * ms)
        out["router TTFT"].append((first - root["start"]) * ms)
        out["mesh part (TTFT - prefill)"].append((first - root["start"] - (eng_first - eng["start"])) * ms)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("spans", help="the JSONL trace file the services wrote (TOKENRELAY_TRACE_FILE)")
    p.add_argument("--json", default="", help="also write the per-phase percentiles here")
    args = p.parse_args(argv)
    out = breakdown(args.spans)
    n = len(out.get("router TTFT", []))
    if not n:
        print("no complete request traces in", args.spans, file=sys.stderr)
        return 1
    rows = {}
    print(f"{n} requests; milliseconds")
    print(f"{'phase':<28} {'p50':>7} {'p90':>7} {'p99':>7} {'mean':>7}")
    for name in PHASES:
        v = out.get(name)
        if not v:
            continue
        rows[name] = {"p50": pct(v, 0.5), "p90": pct(v, 0.9), "p99": pct(v, 0.99), "mean": statistics.fmean(v)}
        r = rows[name]
        print(f"{name:<28} {r['p50']:7.3f} {r['p90']:7.3f} {r['p99']:7.3f} {r['mean']:7.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"requests": n, "phases": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
