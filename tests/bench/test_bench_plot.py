"""`--plot` charts when requests fail: empty axes say "no data" and why; throughput spans the whole run."""

from __future__ import annotations

import pathlib

import pytest

from tokenrelay_tools.bench.runner import RequestRecord, RunResult

pytest.importorskip("matplotlib")
from tokenrelay_tools.bench.plot import latency_figure, run_end, throughput_figure, write_plots


def _ok(i: int, start: float, e2e: float = 0.5, tokens: int = 4) -> RequestRecord:
    r = RequestRecord(index=i, session=i, turn=0, tenant="t", priority="normal", cls="c", start=start,
                      ttft=0.05, e2e=e2e, tpot=0.01, itl=[0.01] * (tokens - 1), completion_tokens=tokens)
    r.end = start + e2e
    r.deltas = [(start + 0.05 + 0.01 * k, 1) for k in range(tokens)]
    return r


def _failed(i: int, start: float, end: float, reason: str = "BENCH_DRAIN_TIMEOUT") -> RequestRecord:
    return RequestRecord(index=i, session=i, turn=0, tenant="t", priority="normal", cls="c", start=start,
                         end=end, status="CANCELLED", reason=reason)


def _run(records: list[RequestRecord], stopped_at: float | None = None, wall: float | None = None) -> RunResult:
    return RunResult(target={"target": "fake"}, workload="w", mode="poisson", seed=1, records=records,
                     wall=max((r.end or r.start for r in records), default=0.0) if wall is None else wall,
                     stopped_by="duration", stopped_at=stopped_at)


def _texts(ax) -> str:
    return " | ".join(t.get_text() for t in ax.texts)


def _close(fig) -> None:
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_latency_axes_without_data_say_no_data_and_why() -> None:
    failed = [_failed(i, 0.1 * i, 60.0 + i, "TENANT_CONCURRENCY_LIMIT") for i in range(3)]
    fig = latency_figure({"mesh": _run(failed)}, "w")
    try:
        for ax in fig.axes:
            assert _texts(ax) == "no data\nno successful requests (3 of 3 failed)"
    finally:
        _close(fig)


def test_an_itl_axis_is_empty_when_every_reply_had_one_token() -> None:
    fig = latency_figure({"mesh": _run([_ok(0, 0.0, tokens=1), _ok(1, 1.0, tokens=1)])}, "w")
    try:
        ttft, itl, e2e = fig.axes
        assert not ttft.texts and not e2e.texts
        assert _texts(itl) == "no data\nno successful reply had more than one token"
    finally:
        _close(fig)


def test_compare_gives_a_target_without_data_a_legend_entry_saying_why() -> None:
    fig = latency_figure({"engine": _run([_ok(0, 0.0)]), "mesh": _run([_failed(0, 0.0, 1.0)])}, "w")
    try:
        labels = fig.axes[0].get_legend_handles_labels()[1]
        assert labels == ["engine (n=1)", "mesh: no data (no successful requests (1 of 1 failed))"]
    finally:
        _close(fig)


def test_the_throughput_chart_runs_to_the_last_failure_and_draws_the_failures() -> None:
    # The reported shape: successes until 30 s, then requests cut off by the drain between 60 and 90 s.
    records = [_ok(i, float(i)) for i in range(30)] + [_failed(30 + i, 50.0 + i, 60.0 + 2 * i) for i in range(16)]
    res = _run(records, stopped_at=60.0, wall=30.5)  # a wall that stops at the last success, as before
    assert run_end(res) == 90.0
    fig = throughput_figure({"mesh": res}, "w")
    try:
        ax_tok, ax_req = fig.axes
        assert ax_req.get_xlim()[1] >= 90.0
        labels = ax_req.get_legend_handles_labels()[1]
        assert "mesh failed (16)" in labels and "mesh draining (stopped by duration)" in labels
        failed = next(line for line in ax_req.get_lines() if line.get_label() == "mesh failed (16)")
        x, y = failed.get_data()
        # One failure every 2 s from 60 s; the one at 90 s is in the last bin, [89, 90], drawn to 90 s.
        assert y[:-1].sum() == 16 and min(x[y > 0]) == 60.0 and max(x[:-1][y[:-1] > 0]) == 89.0 and x[-1] == 90.0
        assert not ax_tok.texts
    finally:
        _close(fig)


def test_a_throughput_chart_without_tokens_says_so() -> None:
    fig = throughput_figure({"mesh": _run([_failed(i, 0.0, 60.0) for i in range(2)])}, "w")
    try:
        assert _texts(fig.axes[0]) == "no output tokens\nno successful requests (2 of 2 failed)"
        assert fig.axes[1].get_xlim()[1] >= 60.0
    finally:
        _close(fig)


def test_charts_of_a_run_that_issued_nothing_are_still_written(tmp_path: pathlib.Path) -> None:
    paths = write_plots({"mesh": _run([])}, tmp_path)
    assert all(p.stat().st_size > 0 for p in paths)
    fig = latency_figure({"mesh": _run([])}, "w")
    try:
        assert _texts(fig.axes[0]) == "no data\nno requests were issued"
    finally:
        _close(fig)
