"""bench/bench_relay.py end to end, small and fast: real redis-server, tokenizer, sim engine and
router processes, two load processes, the mesh then the engine alone; every figure is reported."""

from __future__ import annotations

import json
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import bench_relay  # noqa: E402


def test_cpu_lists() -> None:
    assert bench_relay.cpu_list("") == []
    assert bench_relay.cpu_list("0,2-4, 7") == [0, 2, 3, 4, 7]


def test_a_small_run_reports_mesh_and_engine_alone(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "relay.json"
    assert bench_relay.main(["--streams", "8", "--duration", "1.5", "--warmup", "0.5", "--clients", "2",
                             "--max-tokens", "32", "--step-ms", "2", "--json-out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["target"], r["streams"]) for r in rows] == [("mesh", 8), ("engine", 8)]
    for row in rows:
        assert row["errors"] == 0, row["last_error"]
        assert row["requests"] > 0 and row["tokens_per_s"] > 0 and row["messages_per_s"] > 0
        assert row["cpu_seconds"] > 0 and row["tokens_per_cpu_s"] > 0 and row["messages_per_cpu_s"] > 0
        assert row["tokens_per_message"] >= 1.0
        assert 0 < row["ttft_p50_ms"] <= row["ttft_p99_ms"]
    mesh = rows[0]
    assert mesh["cpu_of"] == "routers" and 0 < mesh["ratio_to_engine"] < 2
    assert set(mesh["other_cpu_seconds"]) == {"redis", "tokenizers", "engines"}
    assert mesh["other_cpu_seconds"]["engines"] > 0 and rows[1]["other_cpu_seconds"] == {}


def test_the_bare_baseline_and_coarse_deltas(tmp_path: pathlib.Path) -> None:
    """`--targets bare`: a bare grpc.aio Generate server on the router's CPU, driven by the same clients,
    one token per message; the mesh row carries its messages per CPU-second as a ratio of the bare one's.
    `--min-delta-tokens 4`: the mesh's deltas after the first carry at least 4 tokens (more when more
    were ready), so a 32-token reply comes in at most 9 deltas; without the option, ~1 token each."""
    out = tmp_path / "relay.json"
    assert bench_relay.main(["--streams", "6", "--duration", "1.5", "--warmup", "0.5", "--clients", "2",
                             "--max-tokens", "32", "--step-ms", "2", "--targets", "mesh", "bare",
                             "--min-delta-tokens", "4", "--json-out", str(out)]) == 0
    mesh, bare = json.loads(out.read_text())["rows"]
    assert (mesh["target"], bare["target"], bare["cpu_of"]) == ("mesh", "bare", "bare server")
    for row in (mesh, bare):
        assert row["errors"] == 0 and row["requests"] > 0, row["last_error"]
        assert row["cpu_seconds"] > 0 and row["messages_per_cpu_s"] > 0
    assert bare["tokens_per_message"] == 1.0
    assert mesh["tokens_per_message"] >= 32 / 9 * 0.9    # the window's edges cut some replies
    assert mesh["ratio_to_bare"] == mesh["messages_per_cpu_s"] / bare["messages_per_cpu_s"]
    assert "ratio_to_bare" not in bare


def test_the_mesh_over_the_stream_api_carries_many_requests_per_message(tmp_path: pathlib.Path) -> None:
    """`--mesh-calls stream`: each load process puts its requests on one open Stream call, so a client
    message carries the deltas of the requests ready together (one token each per 2 ms step here)."""
    out = tmp_path / "relay.json"
    assert bench_relay.main(["--streams", "8", "--duration", "1.5", "--warmup", "0.5", "--clients", "2",
                             "--max-tokens", "32", "--step-ms", "2", "--targets", "mesh", "--mesh-calls", "stream",
                             "--json-out", str(out)]) == 0
    (mesh,) = json.loads(out.read_text())["rows"]
    assert mesh["errors"] == 0, mesh["last_error"]
    assert mesh["requests"] > 0 and mesh["tokens_per_s"] > 0 and 0 < mesh["ttft_p50_ms"] <= mesh["ttft_p99_ms"]
    assert mesh["tokens_per_message"] >= 2.0, mesh


def test_a_gap_between_requests_paces_each_stream(tmp_path: pathlib.Path) -> None:
    """`--gap-ms`: each stream waits that long after a request (requests at light load, whose code
    runs cold); back to back, the bare server answers thousands in the same window."""
    out = tmp_path / "relay.json"
    assert bench_relay.main(["--streams", "2", "--duration", "1.5", "--warmup", "0.3", "--clients", "1",
                             "--max-tokens", "1", "--targets", "bare", "--gap-ms", "100",
                             "--json-out", str(out)]) == 0
    (bare,) = json.loads(out.read_text())["rows"]
    assert bare["errors"] == 0, bare["last_error"]
    assert 2 <= bare["requests"] <= 2 * (1.5 / 0.1 + 1)


def test_streams_spread_evenly_over_engines() -> None:
    # One engine: each load process's whole share at it, as before.
    assert bench_relay.spread(10, 3, 1) == [[(0, 4)], [(0, 3)], [(0, 3)]]
    for streams, clients, targets in [(8, 2, 2), (10, 3, 4), (1024, 10, 8), (7, 10, 3), (5, 2, 8)]:
        plan = bench_relay.spread(streams, clients, targets)
        assert len(plan) == min(clients, streams)
        per_target = [0] * targets
        for pairs in plan:
            for target, n in pairs:
                per_target[target] += n
        assert sum(per_target) == streams
        used = per_target if streams >= targets else [n for n in per_target if n]
        assert max(used) - min(used) <= 1 and len([n for n in per_target if n]) == min(streams, targets)
    assert bench_relay.cpu_share([3, 4], 0, 1) == [3, 4]  # a lone engine keeps the whole list
    assert [bench_relay.cpu_share([3, 4], i, 3) for i in range(3)] == [[3], [4], [3]]


def test_every_router_gets_its_share_with_fewer_load_processes_than_routers() -> None:
    # Device run 1 of 2026-12-03d: 3 load processes, 9 routers, each process at one router: 6 routers idle.
    routers = [f"r{i}" for i in range(9)]
    load = bench_relay.Load("mesh", routers, 1024, 16, "p", 0, 1, 0)
    per_router = dict.fromkeys(routers, 0)
    for pairs in bench_relay.load_plan(load, 3):
        for address, n in pairs:
            per_router[address] += n
    assert sum(per_router.values()) == 1024 and set(per_router.values()) <= {113, 114}


def test_a_two_engine_run_spreads_the_baseline(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "relay.json"
    # A 2 s window: in a 1 s one a loaded CI machine once finished no request in the engines (the
    # clients count requests that started in the window; the engines, those that ended in it).
    assert bench_relay.main(["--streams", "6", "--duration", "2", "--warmup", "0.4", "--clients", "3",
                             "--engines", "2", "--tokenizers", "2", "--max-tokens", "16", "--step-ms", "2",
                             "--json-out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["args"]["engines"] == 2 and report["args"]["tokenizers"] == 2
    rows = report["rows"]
    assert [(r["target"], r["engines"], r["tokenizers"]) for r in rows] == [("mesh", 2, 2), ("engine", 2, 2)]
    for row in rows:
        assert row["errors"] == 0, row["last_error"]
        assert row["requests"] > 0 and row["tokens_per_s"] > 0
    mesh, engines = rows
    assert engines["cpu_of"] == "engines"
    assert sorted(engines["streams_by_address"].values()) == [3, 3]
    assert len(engines["tokens_per_s_by_address"]) == 2 and all(engines["tokens_per_s_by_address"].values())
    assert abs(sum(engines["tokens_per_s_by_address"].values()) - engines["tokens_per_s"]) < 1e-6
    assert len(mesh["engine_finished_by_engine"]) == 2 and sum(mesh["engine_finished_by_engine"]) > 0
    assert 0 < mesh["ratio_to_engine"] < 2


def test_the_probe_reports_its_work_per_cpu_second() -> None:
    import multiprocessing as mp
    import threading

    ctx = mp.get_context("spawn")
    stop, out = ctx.Event(), ctx.Queue()
    threading.Timer(0.3, stop.set).start()
    bench_relay._probe(None, stop, out)        # in this process, on no CPU in particular
    rate = out.get(timeout=5)
    assert 1_000 < rate < 1e9                  # iterations of its fixed loop per CPU-second
