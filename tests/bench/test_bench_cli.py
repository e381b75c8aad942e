"""The bench command line: help, listing, and the usage errors that must stop a run before it starts."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

from tests.bench.benchkit import bench_args
from tokenrelay_tools.bench.cli import run_bench

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_module_entry_point_prints_help() -> None:
    out = subprocess.run([sys.executable, "-m", "tokenrelay_tools.bench", "--help"], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0
    for flag in ("--workload", "--compare", "--engine-address", "--slo-ttft", "--plot", "--api-key"):
        assert flag in out.stdout


async def test_list_workloads_names_the_shipped_ones(capsys: pytest.CaptureFixture[str]) -> None:
    assert await run_bench(bench_args("--list-workloads")) == 0
    listed = {line.split()[0] for line in capsys.readouterr().out.splitlines()}
    assert {"chat-multiturn", "long-context", "mixed-tenants", "burst"} <= listed


@pytest.mark.parametrize("argv, message", [
    (["--workload", "nope"], "unknown workload"),
    (["--target", "engine", "--engine-address", "10.1.2.3:50051", "--vocab-size", "100"], "only loopback"),
    (["--target", "engine", "--engine-address", "127.0.0.1:1"], "--vocab-size"),
    (["--state-file", "/nonexistent/state.json"], "no running mesh"),
    (["--duration", "0", "--target", "engine", "--engine-address", "127.0.0.1:1", "--vocab-size", "9"],
     "unbounded"),
])
async def test_usage_errors_exit_2_with_one_line(argv: list[str], message: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    if "--state-file" not in argv:  # never read the developer's real mesh state
        argv = [*argv, "--state-file", "/nonexistent/state.json"]
    assert await run_bench(bench_args(*argv)) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


async def test_an_unreachable_engine_fails_the_run_without_a_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = bench_args("--target", "engine", "--engine-address", f"127.0.0.1:{port}", "--vocab-size", "100",
                 "--requests", "2", "--no-progress")
    assert await run_bench(args) == 1
    assert "could not start" in capsys.readouterr().err
