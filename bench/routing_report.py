"""Metrics of one bench_routing.py run (trace x router configuration), the table and the target checks."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from routing_oracle import hit_rate


@dataclass
class Req:
    """One request as the client saw it."""

    cid: int
    turn: int
    prompt: list[int]
    max_tokens: int
    rid: str = ""
    sent: float = 0.0
    ttft: float = math.nan            # seconds from send to the first token
    e2e: float = math.nan
    server_ttft: float = math.nan     # tokenrelay: the router's own (request received -> first token sent)
    engine_ttft: float = math.nan     # submit to the engine -> its first token back at the router / adapter
    reply: list[int] = field(default_factory=list)
    cached: int = 0                   # prompt tokens the engine served from its cache (usage)
    replica: int = -1                 # engine index, -1 = unknown
    error: str = ""


@dataclass
class Sample:
    t: float
    inflight: list[int]               # active + queued per replica
    kv_used: list[int]
    kv_total: list[int]


def percentile(values: Sequence[float], q: float) -> float:
    vals = sorted(v for v in values if not math.isnan(v))
    if not vals:
        return math.nan
    k = (len(vals) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return vals[lo] + (vals[hi] - vals[lo]) * (k - lo)


def summarize(trace: str, config: str, reqs: list[Req], samples: list[Sample], counters: dict[str, list[int]],
              wall: float, slo_ttft: float, tokens_per_block: int, replicas: int,
              concurrency: int) -> dict[str, Any]:
    ok = [r for r in reqs if not r.error]
    prompt_tot = sum(counters["prompt"])
    cached_tot = sum(counters["cached"])
    order = sorted(ok, key=lambda r: r.sent)
    o_cached, o_total = hit_rate(((r.prompt, r.reply) for r in order), tokens_per_block)
    f_cached, f_total = hit_rate(((r.prompt, r.reply) for r in order), tokens_per_block, replies=True)
    oracle = o_cached / o_total if o_total else math.nan
    hit = cached_tot / prompt_tot if prompt_tot else math.nan
    # In-flight per replica averaged over the steady samples (the pool holds at least half of the
    # trace's concurrency: not the start, nor the drain at the end, when the last conversations run
    # alone); imbalance = max / mean of those averages.
    steady = [s for s in samples if sum(s.inflight) >= 0.5 * concurrency] or samples
    means = [sum(s.inflight[i] for s in steady) / len(steady) for i in range(replicas)] if steady else []
    mean_all = sum(means) / len(means) if means else 0.0
    peak = [max((s.inflight[i] for s in samples), default=0) for i in range(replicas)]
    per_replica = [sum(1 for r in ok if r.replica == i) for i in range(replicas)]
    known = sum(per_replica)
    kv_ratio = max((s.kv_used[i] / s.kv_total[i] for s in samples for i in range(replicas) if s.kv_total[i]),
                   default=math.nan)
    kv_over = any(s.kv_used[i] > s.kv_total[i] for s in samples for i in range(replicas))
    by_turn = {(r.cid, r.turn): r for r in ok}
    follow = [r for r in ok if r.turn > 0 and (r.cid, r.turn - 1) in by_turn and r.replica >= 0]
    same = sum(1 for r in follow if by_turn[(r.cid, r.turn - 1)].replica == r.replica)
    ttfts = [r.ttft for r in ok]
    return {
        "trace": trace, "config": config, "requests": len(reqs), "errors": len(reqs) - len(ok),
        "errors_sample": sorted({r.error for r in reqs if r.error})[:3],
        "wall_s": wall,
        "hit_rate": hit, "oracle_hit_rate": oracle,
        "hit_vs_oracle": hit / oracle if oracle else math.nan,
        "oracle_with_replies": f_cached / f_total if f_total else math.nan,
        "client_hit_rate": sum(r.cached for r in ok) / max(1, sum(len(r.prompt) for r in ok)),
        "ttft_p50_s": percentile(ttfts, 0.5), "ttft_p99_s": percentile(ttfts, 0.99),
        "router_ttft_p50_s": percentile([r.server_ttft for r in ok], 0.5),
        "engine_ttft_p50_s": percentile([r.engine_ttft for r in ok], 0.5),
        "engine_ttft_p99_s": percentile([r.engine_ttft for r in ok], 0.99),
        "output_tok_s": sum(len(r.reply) for r in ok) / wall if wall else math.nan,
        "goodput_rps": sum(1 for r in ok if r.ttft <= slo_ttft) / wall if wall else math.nan,
        "goodput_share": sum(1 for r in ok if r.ttft <= slo_ttft) / len(reqs) if reqs else math.nan,
        "imbalance_inflight": max(means) / mean_all if mean_all else math.nan,
        "inflight_mean": means, "inflight_peak": peak, "steady_samples": len(steady), "samples": len(samples),
        "requests_per_replica": per_replica,
        "imbalance_requests": (max(per_replica) / (known / replicas)) if known else math.nan,
        "kv_used_max_ratio": kv_ratio, "kv_over_capacity": kv_over,
        "followup_same_replica": same / len(follow) if follow else math.nan,
        "prompt_tokens_per_replica": counters["prompt"], "cached_tokens_per_replica": counters["cached"],
    }


COLUMNS = [("trace", "trace", "{}"), ("config", "config", "{}"), ("hit", "hit_rate", "{:.3f}"),
           ("oracle", "oracle_hit_rate", "{:.3f}"), ("/orc", "hit_vs_oracle", "{:.2f}"),
           ("orc+rep", "oracle_with_replies", "{:.3f}"),
           ("ttft50ms", "ttft_p50_s", "ms"), ("ttft99ms", "ttft_p99_s", "ms"),
           ("eng50ms", "engine_ttft_p50_s", "ms"), ("tok/s", "output_tok_s", "{:.0f}"),
           ("imb", "imbalance_inflight", "{:.2f}"), ("imbReq", "imbalance_requests", "{:.2f}"),
           ("good", "goodput_share", "{:.2f}"), ("kvMax", "kv_used_max_ratio", "{:.3f}"),
           ("same", "followup_same_replica", "{:.2f}"), ("err", "errors", "{}")]


def _cell(fmt: str, value: Any) -> str:
    if isinstance(value, float) and math.isnan(value):
        return "-"
    if fmt == "ms":
        return f"{value * 1000:.0f}"
    return fmt.format(value)


def table(rows: list[dict[str, Any]]) -> str:
    cells = [[h for h, _, _ in COLUMNS]] + [[_cell(f, r.get(k, math.nan)) for _, k, f in COLUMNS] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(c[i].ljust(widths[i]) for i in range(len(COLUMNS))) for c in cells)


def checks(rows: list[dict[str, Any]], prefix: str = "prefix") -> list[tuple[str, bool | None, str]]:
    """The issue's targets: (name, PASS / MISS / None = not measured, detail)."""
    def get(trace: str, config: str) -> dict[str, Any] | None:
        return next((r for r in rows if r["trace"] == trace and r["config"] == config), None)

    out: list[tuple[str, bool | None, str]] = []
    for trace in sorted({r["trace"] for r in rows}):
        tr, sg = get(trace, prefix), get(trace, "sglang-cache_aware")
        if tr and sg:
            out.append((f"{trace}: tokenrelay hit rate >= SGLang's", tr["hit_rate"] >= sg["hit_rate"],
                        f"{tr['hit_rate']:.3f} vs {sg['hit_rate']:.3f}"))
        else:
            out.append((f"{trace}: tokenrelay hit rate >= SGLang's", None,
                        f"needs configs {prefix}, sglang-cache_aware"))
    tr = get("chat-multiturn", prefix)
    out.append(("chat-multiturn: hit rate >= 0.98 x oracle", None if tr is None else tr["hit_vs_oracle"] >= 0.98,
                "" if tr is None else f"{tr['hit_vs_oracle']:.3f} x oracle"))
    tr, sg = get("evict", prefix), get("evict", "sglang-cache_aware")
    out.append(("evict: hit rate strictly above SGLang's", None if not (tr and sg) else tr["hit_rate"] > sg["hit_rate"],
                "" if not (tr and sg) else f"{tr['hit_rate']:.3f} vs {sg['hit_rate']:.3f}"))
    tr = get("shared-hot", prefix)
    sg = get("shared-hot", "sglang-cache_aware")
    out.append(("shared-hot: imbalance <= 1.25", None if tr is None else tr["imbalance_inflight"] <= 1.25,
                "" if tr is None else f"{tr['imbalance_inflight']:.2f}"
                + (f" (SGLang {sg['imbalance_inflight']:.2f})" if sg else "")))
    out.append(("shared-hot: no replica above its KV capacity", None if tr is None else not tr["kv_over_capacity"],
                "" if tr is None else f"max used/total {tr['kv_used_max_ratio']:.2f}"))
    for trace in sorted({r["trace"] for r in rows}):
        tr, rr = get(trace, prefix), get(trace, "round-robin")
        for key, what in (("ttft_p50_s", "TTFT p50"), ("engine_ttft_p50_s", "engine-side TTFT p50")):
            if tr and rr:
                out.append((f"{trace}: {what} <= half of round-robin's", tr[key] <= rr[key] / 2,
                            f"{tr[key] * 1000:.0f} ms vs {rr[key] * 1000:.0f} ms"))
    for trace in sorted({r["trace"] for r in rows}):
        one, two = get(trace, prefix), get(trace, f"{prefix}-2routers")
        if one and two:
            out.append((f"{trace}: 2 routers' hit rate within 2% of one's",
                        abs(two["hit_rate"] - one["hit_rate"]) <= 0.02 * one["hit_rate"],
                        f"{two['hit_rate']:.3f} vs {one['hit_rate']:.3f}"))
    return out


def render_checks(results: list[tuple[str, bool | None, str]]) -> str:
    word = {True: "PASS", False: "MISS", None: "N/A "}
    return "\n".join(f"{word[ok]}  {name}" + (f"  ({detail})" if detail else "") for name, ok, detail in results)
