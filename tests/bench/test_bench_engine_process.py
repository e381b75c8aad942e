"""`tokenrelay bench --target engine` end to end: a real engine_svc process (sim backend, port 0),
the command line parsed as the CLI parses it, and the JSON report it writes."""

from __future__ import annotations

import json
import pathlib

import pytest

from tests.bench.benchkit import bench_args
from tokenrelay_tools.bench.cli import run_bench

WORKLOAD = """
name: tiny
arrival: {mode: closed, concurrency: 3}
tenants:
  - {name: alpha, weight: 2, priorities: {high: 1}}
  - {name: beta, weight: 1, priorities: {low: 1}}
classes:
  - name: chat
    kind: chat
    turns: 3
    system_tokens: 40
    shared_system: true
    prompt_tokens: {dist: lognormal, median: 20, sigma: 0.5, min: 4, max: 60}
    output_tokens: {dist: uniform, min: 4, max: 12}
  - name: single
    prompt_tokens: {dist: uniform, min: 10, max: 80}
    output_tokens: 6
"""


async def test_engine_bench_reports_every_request_with_exact_token_counts(engine, tmp_path: pathlib.Path) -> None:
    address = await engine()
    (tmp_path / "tiny.yaml").write_text(WORKLOAD)
    out, per_request = tmp_path / "report.json", tmp_path / "requests.jsonl"
    args = bench_args("--workload", str(tmp_path / "tiny.yaml"), "--target", "engine", "--engine-address", address,
                 "--vocab-size", "512", "--requests", "24", "--seed", "7", "--slo-ttft", "5", "--slo-itl", "1",
                 "--json", str(out), "--save-requests", str(per_request), "--no-progress")
    assert await run_bench(args) == 0

    report = json.loads(out.read_text())["runs"]["engine"]
    summary = report["summary"]
    assert report["target"]["max_context"] == 512 and report["stopped_by"] == "requests"
    assert summary["requests"] == 24 and summary["ok"] == 24 and summary["errors"] == 0
    assert sum(g["requests"] for g in report["by_tenant"].values()) == 24
    assert set(report["by_tenant"]) <= {"alpha", "beta"} and set(report["by_priority"]) <= {"high", "low"}
    assert sum(g["requests"] for g in report["by_class"].values()) == 24
    assert summary["ttft"]["n"] == 24 and summary["ttft"]["p99"] <= summary["ttft"]["max"]
    assert summary["goodput"]["met"] == 24  # generous SLOs: every request meets them

    rows = [json.loads(line) for line in per_request.read_text().splitlines()]
    assert len(rows) == 24
    # ignore_eos: the engine generated exactly what was planned; ids in, so prompts are exact too.
    assert sum(r["completion_tokens"] for r in rows) == summary["tokens"]["completion"]
    assert all(r["completion_tokens"] == r["planned_output_tokens"] for r in rows)
    firsts = [r for r in rows if r["turn"] == 0]
    assert all(r["prompt_tokens"] == r["planned_prompt_tokens"] + (40 if r["cls"] == "chat" else 0) for r in firsts)
    # A chat turn reuses the KV of its conversation so far: at least every full 32-token block
    # (the sim's default block size) of the previous turn's prompt is a cache hit.
    by_turn = {(r["session"], r["turn"]): r for r in rows}
    later = [(by_turn[(r["session"], r["turn"] - 1)], r) for r in rows if r["turn"] > 0]
    assert later and all(r["prompt_tokens"] > prev["prompt_tokens"] + prev["completion_tokens"] for prev, r in later)
    assert all(r["cached_tokens"] >= prev["prompt_tokens"] // 32 * 32 for prev, r in later)


async def test_an_overloaded_engine_shows_up_as_errors_by_status_and_reason(engine, tmp_path: pathlib.Path) -> None:
    # Room for one request and no queue: concurrent sessions are rejected with OVERLOADED.
    address = await engine("--sim-max-batch-size", "1", "--max-queued", "0", "--sim-decode-step-time", "0.01")
    out = tmp_path / "report.json"
    args = bench_args("--workload", "burst", "--target", "engine", "--engine-address", address, "--vocab-size", "512",
                 "--concurrency", "4", "--requests", "16", "--length-scale", "0.1", "--json", str(out),
                 "--no-progress", "--min-success", "0")  # mostly errors, on purpose: no exit 1 for that here
    assert await run_bench(args) == 0
    summary = json.loads(out.read_text())["runs"]["engine"]["summary"]
    assert summary["requests"] == 16 and summary["ok"] >= 1
    assert summary["errors"] == summary["errors_by_reason"].get("UNAVAILABLE/OVERLOADED", 0) > 0
    assert summary["ok"] + summary["errors"] == 16


async def test_plots_are_written_when_matplotlib_is_installed(engine, tmp_path: pathlib.Path) -> None:
    pytest.importorskip("matplotlib")
    address = await engine()
    args = bench_args("--workload", "chat-multiturn", "--target", "engine", "--engine-address", address,
                 "--vocab-size", "512", "--requests", "8", "--concurrency", "4", "--length-scale", "0.3",
                 "--plot", str(tmp_path / "charts"), "--no-progress")
    assert await run_bench(args) == 0
    for name in ("latency_cdf.png", "throughput.png"):
        data = (tmp_path / "charts" / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


async def test_compare_runs_the_engine_on_the_token_counts_the_mesh_produced(engine, fake_mesh,
                                                                              tmp_path: pathlib.Path) -> None:
    engine_address = await engine()
    mesh_address, _ = fake_mesh  # a fake router: 1 token per 3 chars, +4 per chat message
    (tmp_path / "tiny.yaml").write_text(WORKLOAD)
    out, per_request = tmp_path / "report.json", tmp_path / "requests.jsonl"
    args = bench_args("--workload", str(tmp_path / "tiny.yaml"), "--compare", "--address", mesh_address,
                 "--api-key", "key-a", "--engine-address", engine_address, "--vocab-size", "512",
                 "--requests", "12", "--seed", "3", "--chars-per-token", "3", "--json", str(out),
                 "--save-requests", str(per_request), "--no-progress")
    assert await run_bench(args) == 0

    doc = json.loads(out.read_text())
    assert list(doc["runs"]) == ["engine", "mesh"]  # the baseline first
    assert doc["runs"]["mesh"]["target"]["max_context"] == 512  # learned from the mesh's engine
    assert all(run["summary"]["requests"] == run["summary"]["ok"] == 12 for run in doc["runs"].values())
    assert [row[0] for row in doc["comparison"]][:3] == ["TTFT p50 (ms)", "TTFT p95 (ms)", "TTFT p99 (ms)"]
    assert all(len(row) == 4 for row in doc["comparison"])

    rows = [json.loads(line) for line in per_request.read_text().splitlines()]
    sent = {t: {(r["session"], r["turn"]): (r["prompt_tokens"], r["completion_tokens"]) for r in rows
                if r["target"] == t} for t in ("mesh", "engine")}
    # Same sessions, same turns, same prompt and output lengths: only the path differs.
    assert sent["engine"] == sent["mesh"] and len(sent["mesh"]) == 12
