"""bench_fairness.py's tables: one per scenario, each ending with its targets and PASS / MISS."""

from __future__ import annotations

import argparse
import math
from typing import Any

TITLES = {"a": "a) fairness: 3 quiet tenants at their share + 1 noisy at 10x its share",
          "b": "b) weights 1:2:4, every tenant backlogged",
          "c": "c) priority under saturation: interactive (high) + batch (low)",
          "d": "d) overload: open loop at a multiple of the capacity measured alone"}


def check(name: str, value: float, op: str, target: float | None = None) -> dict[str, Any]:
    """One target: `op` is '<=' or '>=' (PASS / MISS), or 'info' (reported, not judged)."""
    if op == "info" or target is None:
        status = "info"
    elif value is None or (isinstance(value, float) and math.isnan(value)):
        status = "MISS"
    else:
        status = "PASS" if (value <= target if op == "<=" else value >= target) else "MISS"
    return {"name": name, "value": value, "op": op, "target": target, "status": status}


def ms(v: float | None) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if math.isinf(v):
        return "inf"
    return f"{v:.1f}" if v < 100 else f"{v:,.0f}"


def _num(v: Any) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, str):
        return v
    return f"{v:,.3f}" if isinstance(v, float) and abs(v) < 10 else f"{v:,.1f}"


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "|".join(" ---: " for _ in head) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out


def _checks(checks: list[dict[str, Any]]) -> list[str]:
    rows = [[c["name"], _num(c["value"]), "" if c["op"] == "info" else f"{c['op']} {c['target']:g}", c["status"]]
            for c in checks]
    return ["", *_table(["target", "measured", "wanted", "result"], rows)]


def _tenants(rows: list[dict[str, Any]], alone: bool, extra: list[tuple[str, str]]) -> list[str]:
    head = ["tenant", "streams", "requests", "queued %", "queue wait p50 / p99 ms", "TTFT p50 / p99 ms"]
    if alone:
        head.append("alone p50 / p99 ms" if "alone_p50_ms" in rows[0] else "alone p99 ms")
    head += ["served tok/s", "output tok/s", *(h for h, _ in extra)]
    body = []
    for r in rows:
        line = [r["tenant"], str(r["streams"]), str(r["requests"]), f"{r['queued_pct']:.0f}",
                f"{ms(r['queue_p50_ms'])} / {ms(r['queue_p99_ms'])}",
                f"{ms(r['ttft_p50_ms'])} / {ms(r['ttft_p99_ms'])}"]
        if alone:
            line.append(f"{ms(r['alone_p50_ms'])} / {ms(r['alone_p99_ms'])}" if "alone_p50_ms" in r
                        else ms(r["alone_p99_ms"]))
        line += [f"{r['served_tok_s']:,.0f}", f"{r['output_tok_s']:,.0f}"]
        line += [_num(r.get(key)) for _, key in extra]
        body.append(line)
    return _table(head, body)


def render(scenario: str, res: dict[str, Any], args: argparse.Namespace, capacity: int) -> str:
    out = ["", f"## {TITLES[scenario]}",
           f"(C = {capacity} slots, {args.routers} router(s), {args.engines} engine(s) `{args.profile}` batch "
           f"{args.batch} time-scale {args.time_scale:g}, prompt {args.prompt_tokens} tok, "
           f"max_tokens ~{args.max_tokens}, "
           f"{args.seconds:g} s measured per phase)", ""]
    if scenario == "a":
        out += _tenants(res["rows"], True, [("share %", "share_pct")])
        a, n = res["quiet_ttft_alone_ms"], res["quiet_ttft_noisy_ms"]
        out += ["", f"quiet tenants pooled: TTFT p50 / p99 alone {ms(a[0])} / {ms(a[1])} ms, with noisy "
                    f"{ms(n[0])} / {ms(n[1])} ms; their queue wait (router's) p50 / p99 alone "
                    f"{ms(res['quiet_queue_alone_ms'][0])} / {ms(res['quiet_queue_alone_ms'][1])} ms, with noisy "
                    f"{ms(res['quiet_queue_noisy_ms'][0])} / {ms(res['quiet_queue_noisy_ms'][1])} ms; mean lease "
                    f"{_num(res['mean_lease_s'])} s, slot turnover (mean lease / C) {ms(res['slot_turnover_ms'])} ms",
                "(TTFT: from the call; inf = no first token by the end of the tail. queue wait: of requests that "
                "ended `done`)"]
    elif scenario == "b":
        out += _tenants(res["rows"], False, [("weight", "weight"), ("share %", "share_pct"),
                                             ("weight share %", "target_pct"), ("error %", "error_pct")])
    elif scenario == "c":
        out += _tenants(res["rows"], True, [("share %", "share_pct")])
        out += ["", f"SLO {ms(res['slo_ms'])} ms ({args.slo_factor:g}x inter's TTFT p99 alone); batch min_share "
                    f"{res['batch_min_share']:g}"]
    else:
        out += [f"capacity alone {res['capacity_tok_s']:,.0f} output tok/s ({res['capacity_req_s']:.1f} req/s); "
                f"offered {res['offered_req_s']:.1f} req/s ({args.overload:g}x); goodput {res['goodput_tok_s']:,.0f} "
                f"tok/s; {res['requests']} requests, {res['done']} done, {res['refused']} refused at once "
                f"(p50 / p99 {ms(res['rejection_ms'][0])} / {ms(res['rejection_ms'][1])} ms); floor, same phase: "
                f"{res['floor_calls']} calls with an unknown API key (refused before admission) p50 / p99 "
                f"{ms(res['floor_ms'][0])} / {ms(res['floor_ms'][1])} ms", ""]
        out += _table(["outcome [tenant]", "count", "call -> status p50 ms", "p99 ms"],
                      [[t["reason"], str(t["count"]), ms(t["p50_ms"]), ms(t["p99_ms"])] for t in res["reasons"]])
    out += _checks(res["checks"])
    return "\n".join(out)
