"""Runs where most requests fail (issue 14): one line says so, with the top reasons, and the exit is 1.

The reported case: the README's command against the default CPU mesh gave 0 of 46 requests (30
TENANT_CONCURRENCY_LIMIT, 16 drain timeouts; the engine alone 46 BENCH_TIMEOUT), exited 1 with no
message and drew blank charts. Fake targets replay that outcome through the whole command.
"""

from __future__ import annotations

import json
import pathlib

import pytest

from services.errors import Reason
from tests.bench.benchkit import FakeBehaviour, FakeTarget, bench_args
from tokenrelay_tools.bench import cli
from tokenrelay_tools.bench.cli import run_bench

SINGLE = {"name": "single", "prompt_tokens": 20, "output_tokens": 6}
OVERLOAD_HINT = " (more load than the target sustains: lower --rate, --concurrency or --length-scale)"


def _workload_file(tmp_path: pathlib.Path) -> str:
    path = tmp_path / "w.yaml"
    path.write_text(json.dumps({"name": "w", "arrival": {"mode": "constant", "rate": 400}, "classes": [SINGLE]}))
    return str(path)


def _mesh_like_the_report() -> FakeBehaviour:
    """Of 46 sessions, 16 (0, 3, ..., 45) hang until the drain cuts them off; 30 are refused at once."""
    return FakeBehaviour(hang=lambda plan, i: plan.index % 3 == 0,
                         fail=lambda plan, i: Reason.TENANT_CONCURRENCY_LIMIT.error("tenant at its limit"))


def _use(monkeypatch: pytest.MonkeyPatch, **targets: FakeTarget) -> None:
    monkeypatch.setattr(cli, "_targets", lambda args, state: dict(targets))


def _argv(tmp_path: pathlib.Path, *extra: str) -> list[str]:
    return ["--workload", _workload_file(tmp_path), "--requests", "46", "--drain-timeout", "0.2",
            "--request-timeout", "1", "--no-progress", "--state-file", str(tmp_path / "none.json"), *extra]


async def test_a_run_where_nothing_succeeded_says_why_in_one_line_and_exits_1(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    _use(monkeypatch, mesh=FakeTarget(_mesh_like_the_report()))
    assert await run_bench(bench_args(*_argv(tmp_path, "--slo-ttft", "0.5"))) == 1
    out, err = capsys.readouterr()
    assert err.splitlines()[-1] == ("bench: 0 of 46 requests succeeded (30 TENANT_CONCURRENCY_LIMIT, "
                                    "16 BENCH_DRAIN_TIMEOUT); below --min-success 50%; the reason table is above"
                                    f"{OVERLOAD_HINT}")
    assert "RESOURCE_EXHAUSTED/TENANT_CONCURRENCY_LIMIT: 30" in out and "CANCELLED/BENCH_DRAIN_TIMEOUT: 16" in out


async def test_compare_names_each_failed_target_and_still_writes_the_charts(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    # A replay has no drain (it ends when the replayed sessions do): the engine's hung requests end at
    # --request-timeout, as BENCH_TIMEOUT, as in the report.
    engine = FakeTarget(FakeBehaviour(hang=lambda plan, i: True), name="engine")
    _use(monkeypatch, mesh=FakeTarget(_mesh_like_the_report()), engine=engine)
    charts = tmp_path / "charts"
    assert await run_bench(bench_args(*_argv(tmp_path, "--compare", "--plot", str(charts)))) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == ("bench: engine: 0 of 46 requests succeeded (46 BENCH_TIMEOUT); mesh: 0 of 46 requests "
                       "succeeded (30 TENANT_CONCURRENCY_LIMIT, 16 BENCH_DRAIN_TIMEOUT); below --min-success 50%; "
                       f"the reason tables are above{OVERLOAD_HINT}")
    assert {p.name for p in charts.iterdir()} == {"latency_cdf.png", "throughput.png"}


@pytest.mark.parametrize("min_success, status", [(None, 0), ("0.9", 1), ("90%", 1), ("0", 0)])
async def test_min_success_sets_the_share_of_successes_a_run_needs(
        min_success: str | None, status: int, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    # Sessions 0, 4, ..., 44 are refused: 34 of 46 (74%) succeed.
    _use(monkeypatch, mesh=FakeTarget(FakeBehaviour(fail=lambda plan, i: (
        Reason.TENANT_CONCURRENCY_LIMIT.error("limit") if plan.index % 4 == 0 else None))))
    extra = ("--min-success", min_success) if min_success is not None else ()
    assert await run_bench(bench_args(*_argv(tmp_path, *extra))) == status
    err = capsys.readouterr().err
    if status:
        assert err.splitlines()[-1] == ("bench: 34 of 46 requests succeeded (12 TENANT_CONCURRENCY_LIMIT); "
                                        f"below --min-success 90%; the reason table is above{OVERLOAD_HINT}")
    else:
        assert "succeeded" not in err


async def test_failures_that_are_not_overload_get_no_load_hint(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    _use(monkeypatch, mesh=FakeTarget(FakeBehaviour(fail=lambda plan, i: Reason.INVALID_API_KEY.error("no"))))
    assert await run_bench(bench_args(*_argv(tmp_path))) == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        "bench: 0 of 46 requests succeeded (46 INVALID_API_KEY); below --min-success 50%; the reason table is above")


async def test_a_run_that_issued_no_request_fails_saying_so(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    _use(monkeypatch, mesh=FakeTarget())
    argv = _argv(tmp_path, "--min-success", "0", "--max-sessions", "0")  # every arrival is dropped
    argv[argv.index("--requests"):argv.index("--requests") + 2] = ["--duration", "0.05"]
    assert await run_bench(bench_args(*argv)) == 1
    assert capsys.readouterr().err.splitlines()[-1] == "bench: no request was issued (stopped by duration)"


@pytest.mark.parametrize("value", ["1.5", "-0.1", "half", "150%"])
def test_a_min_success_outside_0_to_1_is_a_usage_error(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        bench_args("--min-success", value)
    assert exc.value.code == 2 and "--min-success" in capsys.readouterr().err


def test_help_documents_the_exit_statuses(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        bench_args("--help")
    out = capsys.readouterr().out
    assert "exit status:" in out and "--min-success" in out
    for code in ("0 ", "1 ", "2 ", "130 "):
        assert f"\n  {code}" in out


async def test_an_output_that_cannot_be_written_exits_1_saying_so(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    _use(monkeypatch, mesh=FakeTarget())
    blocked = tmp_path / "file"
    blocked.write_text("")
    assert await run_bench(bench_args(*_argv(tmp_path, "--json", str(blocked / "out.json")))) == 1
    assert "cannot write the results" in capsys.readouterr().err.splitlines()[-1]
