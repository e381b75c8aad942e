"""bench/probe_mix.py's `settle`: a finding inferred from the client's clock (a duplicate id
accepted before the other's last delta reached the client, a Cancel answered "not in flight"
before a delta of its request) is checked against the order of events in the routers' logs: the
second request's claim against the first's end, the Cancel's answer against its request's end.
Explained ones are dropped and listed, confirmed ones marked server-timed (and fail the CI test),
undecidable ones stay client-timed."""

from __future__ import annotations

import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import probe_mix  # noqa: E402


def _done(at: str, rid: str, tenant: str, total_ms: float, claimed_ms: float | None) -> str:
    # The router's line as its console renderer writes it (fields sorted, padded event name).
    return (f"2026-12-04T17:35:{at}Z [info     ] request_done                   cached_tokens=0 completion_tokens=24 "
            f"finish=length prompt_tokens=9 request_id={rid} service=router tenant={tenant} "
            f"total_ms={total_ms} trace_id=e34153b0 ttft_ms=63.97 claimed_ms={claimed_ms}")


def _cancel(at: str, rid: str, tenant: str, cancelled: bool) -> str:
    return (f"2026-12-04T17:35:{at}Z [info     ] cancel_answered                cancelled={cancelled} "
            f"request_id={rid} service=router tenant={tenant}")


def _report(*timed: tuple[str, str, str]) -> probe_mix.Report:
    report = probe_mix.Report()
    for kind, tenant, rid in timed:
        line = report.note(f"{kind}", "done + done", False, f"({rid}) {probe_mix.TIMED}")
        report.timed_finding(kind, tenant, rid, line)
    return report


def test_findings_are_settled_confirmed_or_left_by_the_routers_logs(tmp_path: pathlib.Path) -> None:
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "router.log").write_text("\n".join([
        # d1: the first ran 14.000-14.200 s; the second arrived at 14.150 and claimed at 14.250.
        _done("14.200000", "d1", "a", 200.0, 1.0),
        # d2: the first ran 20.000-20.300; the second claimed at 20.200, while the first ran.
        _done("20.300000", "d2", "a", 300.0, 1.0),
        # c1: its request ended at 30.100, the Cancel said false at 30.150; c2's said false at 39.9,
        # before its request's end at 40.0.
        _done("30.100000", "c1", "b", 100.0, 1.0), _done("40.000000", "c2", "b", 100.0, 1.0),
        "2026-12-04T17:35:41.000000Z [info     ] cluster_joined router_id=x",   # other lines are skipped
    ]) + "\n")
    (tmp_path / "logs" / "router1.log").write_text("\n".join([
        _done("14.300000", "d1", "a", 150.0, 100.0),
        _done("20.400000", "d2", "a", 210.0, 10.0),
        _cancel("30.150000", "c1", "b", False), _cancel("39.900000", "c2", "b", False),
        _done("50.000000", "d3", "a", 100.0, 1.0),          # d3: its second request's line is missing
        _done("51.000000", "d1", "b", 100.0, 1.0),          # another tenant's d1: not d1's
    ]) + "\n")
    report = _report(("duplicate", "a", "d1"), ("duplicate", "a", "d2"), ("cancel", "b", "c1"),
                     ("cancel", "b", "c2"), ("duplicate", "a", "d3"))
    probe_mix.settle(report, tmp_path)
    assert [line.split(" (")[1].split(")")[0] for line in report.settled] == ["d1", "c1"]
    assert "50.0 ms after the first request's end" in report.settled[0]
    assert "50.0 ms after its request's end" in report.settled[1]
    confirmed = [p for p in report.problems if probe_mix.SERVER_TIMED in p]
    assert len(confirmed) == 2 and "(d2)" in confirmed[0] and "(c2)" in confirmed[1]
    assert "100.0 ms before the first request's end" in confirmed[0]
    left = [p for p in report.problems if probe_mix.TIMED in p]
    assert len(left) == 1 and "(d3)" in left[0]
