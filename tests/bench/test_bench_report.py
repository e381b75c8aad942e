"""Measurement and statistics: TTFT/ITL from delta timestamps, percentiles, goodput, tables."""

from __future__ import annotations

import random

import numpy as np
import pytest

from tokenrelay_tools.bench.fairness import WeightError, jain_index, parse_tenant_weights, served_tokens, tenant_weights
from tokenrelay_tools.bench.report import (
    Slo,
    build_report,
    dist_stats,
    failure_reasons,
    format_comparison,
    format_report,
    group_stats,
    success_shortfall,
)
from tokenrelay_tools.bench.runner import RequestRecord, RunResult, _Timing, matched_plan
from tokenrelay_tools.bench.targets import TurnResult
from tokenrelay_tools.bench.workload import SessionPlan, TurnPlan, WorkloadError, parse_workload


def _timing(sent: float, deltas: list[tuple[float, int | None]]) -> _Timing:
    t = _Timing()
    t.sent = sent
    for at, n in deltas:
        t.times.append(at)
        t.counts.append(n)
    return t


def _result(completion: int, finished_at: float) -> TurnResult:
    return TurnResult(prompt_tokens=10, cached_tokens=4, completion_tokens=completion, finish_reason="length",
                      queue_seconds=0.002, context_tokens=10 + completion, finished_at=finished_at)


def test_ttft_itl_and_e2e_come_from_delta_times_divided_by_their_tokens() -> None:
    # First delta at 0.10 s carries 1 token, then 3 tokens 0.06 s later, then a text-only flush,
    # then 2 tokens 0.04 s after the last token-bearing delta.
    timing = _timing(100.0, [(100.10, 1), (100.16, 3), (100.18, 0), (100.20, 2)])
    rec = RequestRecord(index=0, session=0, turn=0, tenant="t", priority="normal", cls="c", start=0.0)
    timing.fill(rec, _result(6, 100.25), t0=100.0)
    assert rec.ttft == pytest.approx(0.10)
    assert rec.e2e == pytest.approx(0.25)
    assert rec.itl == pytest.approx([0.02, 0.02, 0.02, 0.02, 0.02])
    assert rec.tpot == pytest.approx((100.20 - 100.10) / 5)
    assert not rec.itl_estimated
    assert [n for _, n in rec.deltas] == [1, 3, 0, 2]


def test_deltas_without_token_counts_are_split_evenly_and_flagged() -> None:
    timing = _timing(0.0, [(0.1, None), (0.3, None), (0.5, None)])
    rec = RequestRecord(index=0, session=0, turn=0, tenant="t", priority="", cls="c", start=0.0)
    timing.fill(rec, _result(6, 0.5), t0=0.0)
    assert rec.itl_estimated
    assert rec.itl == pytest.approx([0.1, 0.1, 0.1, 0.1])  # 2 tokens per delta, 0.2 s apart


def test_dist_stats_matches_numpy_percentiles() -> None:
    rng = random.Random(4)
    xs = [rng.lognormvariate(0, 1) for _ in range(1001)]
    st = dist_stats(xs)
    assert st is not None and st["n"] == 1001 and st["max"] == max(xs)
    for p in (50, 90, 95, 99):
        assert st[f"p{p}"] == pytest.approx(float(np.percentile(xs, p)))
    assert dist_stats([]) is None


def _rec(i: int, tenant: str, ok: bool = True, ttft: float = 0.1, tpot: float = 0.01,
         status: str = "OK", reason: str = "", priority: str = "normal") -> RequestRecord:
    r = RequestRecord(index=i, session=i, turn=0, tenant=tenant, priority=priority, cls="c", start=float(i),
                      status="OK" if ok else status, reason=reason)
    if ok:
        r.ttft, r.tpot, r.e2e, r.queue = ttft, tpot, ttft + 10 * tpot, 0.001
        r.itl = [tpot] * 10
        r.prompt_tokens, r.cached_tokens, r.completion_tokens = 100, 25, 11
    return r


def test_goodput_counts_failed_requests_as_misses_and_checks_every_slo() -> None:
    recs = [_rec(0, "a"), _rec(1, "a", ttft=0.9), _rec(2, "a", tpot=0.2),
            _rec(3, "a", ok=False, status="UNAVAILABLE", reason="ENGINE_OVERLOADED")]
    g = group_stats(recs, wall=2.0, slo=Slo(ttft=0.5, itl=0.05))
    assert g["goodput"]["met"] == 1 and g["goodput"]["share"] == 0.25
    assert g["goodput"]["requests_per_s"] == 0.5
    assert g["errors_by_reason"] == {"UNAVAILABLE/ENGINE_OVERLOADED": 1}
    assert g["ok"] == 3 and g["throughput"]["output_tokens_per_s"] == 3 * 11 / 2.0
    assert g["tokens"]["cached_share"] == 0.25
    assert "goodput" not in group_stats(recs, wall=2.0, slo=Slo())


def _run(records: list[RequestRecord], name: str = "fake") -> RunResult:
    return RunResult(target={"target": name, "max_context": 0}, workload="w", mode="closed", seed=1,
                     records=records, wall=4.0, sessions=len(records))


def test_report_groups_by_tenant_priority_and_class_and_renders() -> None:
    recs = [_rec(0, "a", priority="high"), _rec(1, "b"), _rec(2, "b"),
            _rec(3, "b", ok=False, status="RESOURCE_EXHAUSTED", reason="TENANT_QUEUE_FULL")]
    report = build_report(_run(recs), Slo(ttft=0.5))
    assert report["summary"]["requests"] == 4
    assert {k: v["requests"] for k, v in report["by_tenant"].items()} == {"a": 1, "b": 3}
    assert {k: v["requests"] for k, v in report["by_priority"].items()} == {"high": 1, "normal": 3}
    assert report["by_tenant"]["b"]["errors_by_status"] == {"RESOURCE_EXHAUSTED": 1}
    text = format_report(report)
    for needle in ("tenant:a", "tenant:b", "priority:high", "class:c", "RESOURCE_EXHAUSTED/TENANT_QUEUE_FULL",
                   "goodput 75.0%"):
        assert needle in text


def test_a_run_where_everything_failed_still_renders() -> None:
    report = build_report(_run([_rec(0, "a", ok=False, status="UNAUTHENTICATED", reason="UNKNOWN_API_KEY")]))
    assert report["summary"]["ttft"] is None
    assert "UNAUTHENTICATED/UNKNOWN_API_KEY: 1" in format_report(report)


def test_comparison_puts_targets_side_by_side_with_the_difference() -> None:
    fast = build_report(_run([_rec(0, "a", ttft=0.010)], "engine"))
    slow = build_report(_run([_rec(0, "a", ttft=0.025)], "mesh"))
    lines = format_comparison({"engine": fast, "mesh": slow}).splitlines()
    assert lines[0].split() == ["metric", "engine", "mesh", "mesh", "−", "engine"]
    ttft = next(line for line in lines if line.startswith("TTFT p50"))
    assert ttft.split()[-3:] == ["10.00", "25.00", "15.00"]


def test_matched_plan_replays_the_prompt_growth_another_target_saw() -> None:
    plan = SessionPlan(index=3, tenant="t", priority="", cls="c", kind="chat", system_tokens=20,
                       turns=(TurnPlan(30, 10), TurnPlan(40, 10, think_time=0.5), TurnPlan(50, 10)))
    sent = []
    for turn, (prompt, completion) in enumerate([(70, 10), (150, 12)]):
        r = RequestRecord(index=turn, session=3, turn=turn, tenant="t", priority="", cls="c", start=0.0)
        r.prompt_tokens, r.completion_tokens = prompt, completion
        sent.append(r)
    m = matched_plan(plan, sent)
    # Turn 0: 70 prompt tokens over a 20-token system prompt; turn 1: 150 - (70 + 10) new tokens.
    assert [(t.prompt_tokens, t.output_tokens) for t in m.turns] == [(50, 10), (70, 12)]
    assert m.turns[1].think_time == 0.5  # the third turn was never sent, so it is dropped


def _mixed(ok: int, failures: dict[tuple[str, str], int]) -> dict:
    recs = [_rec(i, "a") for i in range(ok)]
    for (status, reason), n in failures.items():
        recs += [_rec(len(recs), "a", ok=False, status=status, reason=reason) for _ in range(n)]
    return build_report(_run(recs))


def test_the_success_check_names_the_top_failure_reasons_with_their_counts() -> None:
    report = _mixed(0, {("RESOURCE_EXHAUSTED", "TENANT_CONCURRENCY_LIMIT"): 30,
                        ("CANCELLED", "BENCH_DRAIN_TIMEOUT"): 16})
    assert success_shortfall(report) == ("0 of 46 requests succeeded "
                                         "(30 TENANT_CONCURRENCY_LIMIT, 16 BENCH_DRAIN_TIMEOUT)")
    # The full table is printed whatever the check says.
    text = format_report(report)
    assert "RESOURCE_EXHAUSTED/TENANT_CONCURRENCY_LIMIT: 30" in text and "CANCELLED/BENCH_DRAIN_TIMEOUT: 16" in text


def test_the_success_check_passes_at_the_threshold_and_fails_below_it() -> None:
    half = _mixed(5, {("UNAVAILABLE", "ENGINE_OVERLOADED"): 5})
    assert success_shortfall(half) is None                        # 50% meets the default 50%
    assert success_shortfall(half, 0.6) == "5 of 10 requests succeeded (5 ENGINE_OVERLOADED)"
    assert success_shortfall(_mixed(0, {("UNKNOWN", ""): 1}), 0.0) is None   # 0 turns the share check off
    assert success_shortfall(_mixed(0, {}), 0.0) == "no request was issued (stopped by -)"


def test_the_success_check_keeps_to_three_reasons_and_counts_the_rest() -> None:
    report = _mixed(1, {("A", "R1"): 4, ("B", "R2"): 3, ("C", "R3"): 2, ("D", "R4"): 1, ("UNAVAILABLE", ""): 1})
    assert success_shortfall(report) == "1 of 12 requests succeeded (4 R1, 3 R2, 2 R3, 2 other)"
    assert failure_reasons(report["summary"])[-1] == ("UNAVAILABLE", 1)  # no reason: its status stands in


def test_a_run_without_errors_says_so() -> None:
    assert "errors: none" in format_report(build_report(_run([_rec(0, "a")])))


# ------------------------------------------------------------------ fairness (issue 11)
def test_jain_index_exact_values() -> None:
    assert jain_index([4.0, 4.0, 4.0]) == 1.0
    assert jain_index([7.0]) == 1.0
    assert jain_index([5.0, 0.0, 0.0]) == pytest.approx(1 / 3)      # one tenant got everything: 1/n
    assert jain_index([1.0, 2.0, 3.0]) == pytest.approx(36 / 42)    # (1+2+3)² / (3·(1+4+9))
    assert jain_index([3.0, 1.0]) == pytest.approx(0.8)
    assert jain_index([]) is None and jain_index([0.0, 0.0]) is None


def _fair_records() -> list[RequestRecord]:
    """a: 3 ok (111 tokens each) + 1 refused before any token; b: 1 ok + 1 cut off after 45 tokens."""
    recs = [_rec(0, "a"), _rec(1, "a"), _rec(2, "a"),
            _rec(3, "a", ok=False, status="RESOURCE_EXHAUSTED", reason="TENANT_QUEUE_FULL"),
            _rec(4, "b"), _rec(5, "b", ok=False, status="CANCELLED", reason="BENCH_DRAIN_TIMEOUT")]
    recs[5].prompt_tokens, recs[5].completion_tokens = 40, 5
    for r in recs:
        r.planned_prompt_tokens, r.planned_output_tokens = 100, 20
    return recs


def test_served_tokens_per_tenant_of_successful_and_of_all_requests() -> None:
    assert served_tokens(_fair_records()) == {
        "a": {"requests": 4, "served_ok": 333, "served_all": 333, "offered": 480},
        "b": {"requests": 2, "served_ok": 111, "served_all": 156, "offered": 240}}


def test_jain_index_over_weighted_served_tokens_in_the_report_and_its_text() -> None:
    unweighted = build_report(_run(_fair_records()))["fairness"]
    assert unweighted["jain_ok"] == pytest.approx(0.8)                       # 333 : 111 = 3 : 1
    assert unweighted["jain_all"] == pytest.approx(489 ** 2 / (2 * (333 ** 2 + 156 ** 2)))
    assert unweighted["tenants"]["a"]["share_ok"] == 0.75 and unweighted["tenants"]["a"]["weight"] == 1.0
    # Weighted 3 : 1, the same split is perfectly fair on successful requests.
    report = build_report(_run(_fair_records()), weights={"a": 3.0, "b": 1.0, "idle": 5.0})
    f = report["fairness"]
    assert f["jain_ok"] == pytest.approx(1.0)
    assert f["jain_all"] == pytest.approx(267 ** 2 / (2 * (111 ** 2 + 156 ** 2)))
    assert f["tenants"]["a"]["served_ok_per_weight"] == 111 and set(f["tenants"]) == {"a", "b"}
    text = format_report(report)
    assert "fairness: Jain's index over served tokens / weight: 1.000 successful requests · 0.972 all requests" in text
    row = next(line for line in text.splitlines() if line.startswith("b "))
    assert row.split() == ["b", "1", "2", "240", "111", "25.0%", "111", "156", "31.9%"]


def test_a_run_with_no_tokens_served_has_no_index() -> None:
    report = build_report(_run([_rec(0, "a", ok=False, status="UNAVAILABLE", reason="ENGINE_OVERLOADED")]))
    assert report["fairness"]["jain_ok"] is None and report["fairness"]["jain_all"] is None
    assert "- successful requests · - all requests" in format_report(report)


def test_tenant_weights_come_from_the_flag_then_the_workload_never_from_the_arrival_weight() -> None:
    assert parse_tenant_weights(["a=2", "b=0.5", "a=4"]) == {"a": 4.0, "b": 0.5}
    for bad in ("a", "=2", "a=0", "a=-1", "a=x", "a=nan", "a=inf"):
        with pytest.raises(WeightError, match="--tenant-weight"):
            parse_tenant_weights([bad])
    w = parse_workload({"name": "w", "tenants": [{"name": "noisy", "weight": 6, "fairness_weight": 2},
                                                 {"name": "quiet", "weight": 1}]})
    assert tenant_weights(w, {}) == {"noisy": 2.0}                   # quiet: 1 by default; 6 is its arrival mix
    assert tenant_weights(w, {"noisy": 1.0, "quiet": 3.0}) == {"noisy": 1.0, "quiet": 3.0}
    for value in (0, -1, "two", True):
        with pytest.raises(WorkloadError, match="fairness_weight"):
            parse_workload({"name": "w", "tenants": [{"name": "t", "fairness_weight": value}]})


def test_a_failed_request_counts_the_tokens_streamed_before_it_failed() -> None:
    rec = RequestRecord(index=0, session=0, turn=0, tenant="t", priority="", cls="c", start=0.0,
                        planned_prompt_tokens=30, planned_output_tokens=50)
    _timing(0.0, [(0.1, 2), (0.2, None), (0.3, 0), (0.4, 3)]).partial(rec)
    assert (rec.prompt_tokens, rec.completion_tokens) == (30, 6)      # a delta without a count: one token
    never = RequestRecord(index=1, session=1, turn=0, tenant="t", priority="", cls="c", start=0.0,
                          planned_prompt_tokens=30, planned_output_tokens=50)
    _timing(0.0, []).partial(never)
    assert (never.prompt_tokens, never.completion_tokens) == (0, 0)   # no first token: nothing served
