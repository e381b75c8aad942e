"""Statistics of a run: percentiles per tenant / priority / class, goodput, the JSON and the tables.

Per-tenant served tokens and Jain's index over weighted served tokens come from `fairness`.
Goodput is the share of *all* requests (failed ones count as misses) that met every SLO given:
TTFT, the request's mean inter-token time (TPOT) and end-to-end latency. Throughputs divide by
the run's wall time (start to the last request's end or failure), so drain time is included, as a
user sees it. ``success_shortfall`` is the `--min-success` check behind the command's exit status.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from services.errors import Reason

from .fairness import fairness_report
from .runner import RequestRecord, RunResult

PERCENTILES = (50, 90, 95, 99)
DEFAULT_MIN_SUCCESS = 0.5   # `--min-success`: a run where fewer requests succeeded fails (exit 1)


@dataclass(frozen=True)
class Slo:
    ttft: float | None = None           # seconds
    itl: float | None = None            # seconds per output token after the first (TPOT)
    e2e: float | None = None

    def __bool__(self) -> bool:
        return any(v is not None for v in (self.ttft, self.itl, self.e2e))

    def met(self, r: RequestRecord) -> bool:
        if not r.ok:
            return False
        checks = ((self.ttft, r.ttft), (self.itl, r.tpot), (self.e2e, r.e2e))
        return all(limit is None or (value is not None and value <= limit) for limit, value in checks)

    def describe(self) -> str:
        parts = [f"{k} ≤ {v * 1000:g} ms" for k, v in (("ttft", self.ttft), ("itl", self.itl), ("e2e", self.e2e))
                 if v is not None]
        return ", ".join(parts) or "none"


def dist_stats(values: Iterable[float]) -> dict[str, float] | None:
    """n, mean, p50/p90/p95/p99 and max (seconds), or None when there are no values.

    Percentiles interpolate linearly between the closest ranks (numpy's default method), in plain
    Python so that a base install (no numpy) reports too."""
    a = sorted(float(v) for v in values)
    if not a:
        return None
    out = {"n": len(a), "mean": math.fsum(a) / len(a)}
    out.update({f"p{p}": _percentile(a, p) for p in PERCENTILES})
    out["max"] = a[-1]
    return out


def _percentile(ordered: Sequence[float], p: float) -> float:
    rank = (len(ordered) - 1) * p / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def group_stats(records: Sequence[RequestRecord], wall: float, slo: Slo) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    wall = max(wall, 1e-9)
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    completion = sum(r.completion_tokens for r in ok)
    out: dict[str, Any] = {
        "requests": len(records), "ok": len(ok), "errors": len(records) - len(ok),
        "errors_by_status": dict(Counter(r.status for r in records if not r.ok)),
        "errors_by_reason": dict(Counter(f"{r.status}/{r.reason}" for r in records if not r.ok)),
        "ttft": dist_stats(r.ttft for r in ok if r.ttft is not None),
        "itl": dist_stats(x for r in ok for x in r.itl),
        "tpot": dist_stats(r.tpot for r in ok if r.tpot is not None),
        "e2e": dist_stats(r.e2e for r in ok if r.e2e is not None),
        "queue": dist_stats(r.queue for r in ok if r.queue is not None),
        "server_ttft": dist_stats(r.server_ttft for r in ok if r.server_ttft is not None),
        "tokenize": dist_stats(r.tokenize for r in ok if r.tokenize is not None),
        "itl_estimated": any(r.itl_estimated for r in ok),
        "tokens": {"prompt": prompt, "cached": cached, "completion": completion,
                   "prompt_mean": prompt / len(ok) if ok else 0.0,
                   "completion_mean": completion / len(ok) if ok else 0.0,
                   "cached_share": cached / prompt if prompt else 0.0},
        "throughput": {"requests_per_s": len(ok) / wall, "output_tokens_per_s": completion / wall,
                       "prompt_tokens_per_s": prompt / wall},
    }
    if slo:
        met = sum(1 for r in records if slo.met(r))
        out["goodput"] = {"met": met, "share": met / len(records) if records else 0.0,
                          "requests_per_s": met / wall}
    return out


def _grouped(records: Sequence[RequestRecord], key: Callable[[RequestRecord], str],
             wall: float, slo: Slo) -> dict[str, Any]:
    groups: dict[str, list[RequestRecord]] = {}
    for r in records:
        groups.setdefault(key(r), []).append(r)
    return {k: group_stats(v, wall, slo) for k, v in sorted(groups.items())}


def build_report(result: RunResult, slo: Slo = Slo(), weights: Mapping[str, float] | None = None) -> dict[str, Any]:
    """The machine-readable report of one run (`weights`: tenants' fairness weights, default 1)."""
    recs = result.records
    return {
        "workload": result.workload, "target": result.target, "mode": result.mode, "seed": result.seed,
        "wall_seconds": result.wall, "stopped_by": result.stopped_by, "stopped_at": result.stopped_at,
        "sessions": result.sessions,
        "truncated_sessions": result.truncated_sessions, "clipped_requests": result.clipped_requests,
        "dropped_sessions": result.dropped_sessions, "client_errors": result.client_errors,
        "slo": {k: v for k, v in asdict(slo).items() if v is not None},
        "summary": group_stats(recs, result.wall, slo),
        "by_tenant": _grouped(recs, lambda r: r.tenant, result.wall, slo),
        "by_priority": _grouped(recs, lambda r: r.priority, result.wall, slo),
        "by_class": _grouped(recs, lambda r: r.cls, result.wall, slo),
        "fairness": fairness_report(recs, weights),
    }


# ------------------------------------------------------------------------------ text tables
def _ms(stats: Mapping[str, float] | None, key: str) -> str:
    if not stats:
        return "-"
    v = stats[key] * 1000
    return f"{v:.1f}" if v < 100 else f"{v:.0f}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], left: int = 1) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=True)]
    fmt = [(str.ljust if i < left else str.rjust) for i in range(len(header))]
    lines = ["  ".join(f(str(c), w) for f, c, w in zip(fmt, row, widths, strict=True)).rstrip()
             for row in (header, *rows)]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _pct(x: float) -> str:
    return f"{x * 100:.1f}%"


def _headline(report: Mapping[str, Any]) -> str:
    s, t = report["summary"], report["target"]
    lines = [f"workload {report['workload']} → {t['target']} {t.get('address', '')}  "
             f"({report['mode']}, seed {report['seed']}, stopped by {report['stopped_by'] or '-'})",
             f"wall {report['wall_seconds']:.1f} s · {s['requests']} requests ({s['ok']} ok, {s['errors']} errors) · "
             f"{report['sessions']} sessions · {s['throughput']['requests_per_s']:.2f} req/s · "
             f"{s['throughput']['output_tokens_per_s']:.0f} output tok/s · "
             f"prompt {s['tokens']['prompt_mean']:.0f} tok avg, {_pct(s['tokens']['cached_share'])} cached"]
    if "goodput" in s:
        lines.append(f"goodput {_pct(s['goodput']['share'])} ({s['goodput']['requests_per_s']:.2f} req/s) "
                     f"meeting {Slo(**report['slo']).describe()}")
    extra = {k: report[k] for k in ("truncated_sessions", "clipped_requests", "dropped_sessions") if report[k]}
    if extra:
        lines.append("note: " + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in extra.items()))
    return "\n".join(lines)


def _latency_table(s: Mapping[str, Any]) -> str:
    rows = []
    rows_spec = [("TTFT", "ttft"), ("ITL", "itl"), ("TPOT", "tpot"), ("E2E", "e2e"), ("queue", "queue"),
                 ("server TTFT", "server_ttft"), ("tokenize", "tokenize")]
    for name, key in rows_spec:
        st = s[key]
        if st is None and key in ("server_ttft", "tokenize"):
            continue  # reported by the mesh only
        label = name + (" (est.)" if key == "itl" and s["itl_estimated"] else "")
        rows.append([label, str(st["n"]) if st else "0", _ms(st, "mean"),
                     *(_ms(st, f"p{p}") for p in PERCENTILES), _ms(st, "max")])
    return _table(["latency (ms)", "n", "mean", *(f"p{p}" for p in PERCENTILES), "max"], rows)


def _groups_table(report: Mapping[str, Any]) -> str:
    rows = []
    for title, key in (("tenant", "by_tenant"), ("priority", "by_priority"), ("class", "by_class")):
        for name, g in report[key].items():
            rows.append([f"{title}:{name}", str(g["requests"]), str(g["errors"]),
                         _ms(g["ttft"], "p50"), _ms(g["ttft"], "p99"), _ms(g["itl"], "p50"), _ms(g["itl"], "p99"),
                         _ms(g["e2e"], "p50"), _ms(g["e2e"], "p99"), _ms(g["queue"], "p99"),
                         f"{g['throughput']['output_tokens_per_s']:.0f}",
                         _pct(g["goodput"]["share"]) if "goodput" in g else "-"])
    header = ["group", "reqs", "err", "TTFT p50", "p99", "ITL p50", "p99", "E2E p50", "p99", "queue p99",
              "tok/s", "goodput"]
    return _table(header, rows)


def _fairness_table(report: Mapping[str, Any]) -> str:
    f = report.get("fairness")
    if not f or not f["tenants"]:
        return ""
    rows = [[name, f"{t['weight']:g}", str(t["requests"]), str(t["offered"]), str(t["served_ok"]),
             _pct(t["share_ok"]), f"{t['served_ok_per_weight']:.0f}", str(t["served_all"]), _pct(t["share_all"])]
            for name, t in f["tenants"].items()]
    index = " · ".join(f"{v:.3f} {what}" if v is not None else f"- {what}"
                       for what, v in (("successful requests", f["jain_ok"]), ("all requests", f["jain_all"])))
    header = ["tenant", "weight", "reqs", "offered tok", "served ok", "share", "ok/weight", "served all", "share"]
    return f"fairness: Jain's index over served tokens / weight: {index}\n" + _table(header, rows)


def _errors(report: Mapping[str, Any]) -> str:
    errs = report["summary"]["errors_by_reason"]
    if not errs:
        return "errors: none"
    return "errors:\n" + "\n".join(f"  {k}: {v}" for k, v in sorted(errs.items(), key=lambda kv: -kv[1]))


def failure_reasons(summary: Mapping[str, Any]) -> list[tuple[str, int]]:
    """The failed requests' reasons (the gRPC status where a failure has none), most frequent first."""
    counts: Counter[str] = Counter()
    for key, n in summary["errors_by_reason"].items():
        status, _, reason = key.partition("/")
        counts[reason or status] += n
    return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))


# Failures that say the offered load is more than the target sustains (not a broken setup).
OVERLOAD_REASONS = frozenset({Reason.TENANT_CONCURRENCY_LIMIT, Reason.OVERLOADED, Reason.BENCH_TIMEOUT,
                              Reason.BENCH_DRAIN_TIMEOUT})


def overloaded(report: Mapping[str, Any]) -> bool:
    """Whether the run's most frequent failure reason is an overload (refusals, timeouts, drain cuts)."""
    reasons = failure_reasons(report["summary"])
    return bool(reasons) and reasons[0][0] in OVERLOAD_REASONS


def success_shortfall(report: Mapping[str, Any], min_success: float = DEFAULT_MIN_SUCCESS,
                      top: int = 3) -> str | None:
    """Why this run failed the success check, in a phrase, or None when it passed.

    A run fails when no request was issued, or when fewer than ``min_success`` (a share) of its
    requests succeeded; the phrase names the most frequent failure reasons with their counts."""
    s = report["summary"]
    if not s["requests"]:
        return f"no request was issued (stopped by {report['stopped_by'] or '-'})"
    if s["ok"] >= min_success * s["requests"]:
        return None
    reasons = failure_reasons(s)
    shown = [f"{n} {reason}" for reason, n in reasons[:top]]
    rest = sum(n for _, n in reasons[top:])
    if rest:
        shown.append(f"{rest} other")
    return f"{s['ok']} of {s['requests']} requests succeeded ({', '.join(shown)})"


def format_report(report: Mapping[str, Any]) -> str:
    """The readable form of one run's report."""
    parts = [_headline(report), _latency_table(report["summary"]), _groups_table(report), _fairness_table(report),
             _errors(report)]
    return "\n\n".join(p for p in parts if p) + "\n"


_COMPARE_ROWS: tuple[tuple[str, Callable[[Mapping[str, Any]], float | None]], ...] = (
    ("TTFT p50 (ms)", lambda s: s["ttft"] and s["ttft"]["p50"] * 1000),
    ("TTFT p95 (ms)", lambda s: s["ttft"] and s["ttft"]["p95"] * 1000),
    ("TTFT p99 (ms)", lambda s: s["ttft"] and s["ttft"]["p99"] * 1000),
    ("server TTFT p50 (ms)", lambda s: s["server_ttft"] and s["server_ttft"]["p50"] * 1000),
    ("server TTFT p99 (ms)", lambda s: s["server_ttft"] and s["server_ttft"]["p99"] * 1000),
    ("ITL p50 (ms)", lambda s: s["itl"] and s["itl"]["p50"] * 1000),
    ("ITL p95 (ms)", lambda s: s["itl"] and s["itl"]["p95"] * 1000),
    ("ITL p99 (ms)", lambda s: s["itl"] and s["itl"]["p99"] * 1000),
    ("E2E p50 (ms)", lambda s: s["e2e"] and s["e2e"]["p50"] * 1000),
    ("E2E p99 (ms)", lambda s: s["e2e"] and s["e2e"]["p99"] * 1000),
    ("output tok/s", lambda s: s["throughput"]["output_tokens_per_s"]),
    ("requests/s", lambda s: s["throughput"]["requests_per_s"]),
    ("prompt tok (mean)", lambda s: s["tokens"]["prompt_mean"]),
    ("cached share (%)", lambda s: s["tokens"]["cached_share"] * 100),
    ("errors", lambda s: s["errors"]),
    ("goodput (%)", lambda s: s["goodput"]["share"] * 100 if "goodput" in s else None),
)


def _num(v: float | None) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, int):
        return str(v)
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.2f}"


def comparison_rows(reports: Mapping[str, Mapping[str, Any]]) -> list[list[str]]:
    names = list(reports)
    rows = []
    for label, get in _COMPARE_ROWS:
        values = [get(reports[n]["summary"]) for n in names]
        row = [label, *(_num(v) for v in values)]
        if len(values) == 2:
            a, b = values
            row.append(_num(b - a) if a is not None and b is not None else "-")
        rows.append(row)
    return rows


def format_comparison(reports: Mapping[str, Mapping[str, Any]]) -> str:
    """Targets side by side (the first is the baseline; with two, the last column is b − a)."""
    names = list(reports)
    header = ["metric", *names] + ([f"{names[1]} − {names[0]}"] if len(names) == 2 else [])
    return _table(header, comparison_rows(reports)) + "\n"
