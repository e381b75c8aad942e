"""`tokenrelay bench` reports per-tenant served tokens and Jain's index (issue 11), through the whole
command: weights from --tenant-weight over the workload's fairness_weight, failed requests' partial
tokens counted in served_all, the JSON and the text."""

from __future__ import annotations

import json
import pathlib

import pytest

from services.errors import Reason
from tests.bench.benchkit import FakeTarget, bench_args, workload
from tokenrelay_tools.bench import cli
from tokenrelay_tools.bench.cli import run_bench
from tokenrelay_tools.bench.report import build_report
from tokenrelay_tools.bench.runner import RunConfig, Runner
from tokenrelay_tools.bench.targets import Observer, Target, TargetSession, TurnResult
from tokenrelay_tools.bench.workload import SessionPlan, TurnPlan

SINGLE = {"name": "single", "prompt_tokens": 20, "output_tokens": 6}
TENANTS = [{"name": "a", "weight": 3, "fairness_weight": 4}, {"name": "b", "weight": 1}]


def _workload_file(tmp_path: pathlib.Path) -> str:
    path = tmp_path / "w.yaml"
    path.write_text(json.dumps({"name": "w", "arrival": {"mode": "constant", "rate": 400}, "classes": [SINGLE],
                                "tenants": TENANTS}))
    return str(path)


@pytest.mark.parametrize("flags, weights", [([], {"a": 4.0, "b": 1.0}),
                                            (["--tenant-weight", "b=2", "--tenant-weight", "a=0.5"],
                                             {"a": 0.5, "b": 2.0})])
async def test_the_report_has_served_tokens_and_jain_index_with_the_weights_that_apply(
        flags: list[str], weights: dict[str, float], tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(cli, "_targets", lambda args, state: {"mesh": FakeTarget()})
    out_json = tmp_path / "out.json"
    argv = ["--workload", _workload_file(tmp_path), "--requests", "40", "--no-progress", "--json", str(out_json),
            "--state-file", str(tmp_path / "none.json"), *flags]
    assert await run_bench(bench_args(*argv)) == 0
    f = json.loads(out_json.read_text())["runs"]["mesh"]["fairness"]
    tenants = f["tenants"]
    assert set(tenants) == {"a", "b"} and sum(t["requests"] for t in tenants.values()) == 40
    for name, t in tenants.items():
        assert t["weight"] == weights[name]
        assert t["served_ok"] == t["served_all"] == 26 * t["requests"]   # 20 prompt + 6 completion each
    x = [tenants[n]["served_ok"] / weights[n] for n in ("a", "b")]
    assert f["jain_ok"] == pytest.approx(sum(x) ** 2 / (2 * sum(v * v for v in x)))
    assert f"served tokens / weight: {f['jain_ok']:.3f} successful requests" in capsys.readouterr().out


async def test_a_bad_tenant_weight_is_a_usage_error(tmp_path: pathlib.Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--workload", _workload_file(tmp_path), "--requests", "1", "--tenant-weight", "a=0",
            "--state-file", str(tmp_path / "none.json")]
    assert await run_bench(bench_args(*argv)) == 2
    err = capsys.readouterr().err
    assert "--tenant-weight 'a=0'" in err and err.count("\n") == 1


class _CutOffTarget(Target):
    """Every turn streams 2 tokens and one count-less delta, then fails."""

    max_context = 0

    def session(self, plan: SessionPlan, run_id: str, unique: bool) -> TargetSession:
        return _CutOff()


class _CutOff(TargetSession):
    async def turn(self, turn: TurnPlan, observe: Observer, timeout: float) -> TurnResult:
        observe(2)
        observe(None)
        raise Reason.OVERLOADED.error("cut off mid-stream")


async def test_tokens_streamed_before_a_failure_count_in_served_all_only() -> None:
    w = workload(arrival={"mode": "closed", "concurrency": 2}, classes=[SINGLE])
    result = await Runner(_CutOffTarget(), w, RunConfig(duration=None, requests=5)).run()
    assert len(result.records) == 5 and not any(r.ok for r in result.records)
    assert {(r.prompt_tokens, r.completion_tokens) for r in result.records} == {(20, 3)}
    t = build_report(result)["fairness"]["tenants"]["default"]
    assert (t["served_ok"], t["served_all"], t["offered"]) == (0, 5 * 23, 5 * 26)
