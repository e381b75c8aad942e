"""The floor benchmarks, small and fast, against real processes: bench/bench_lua_cost.py (the
admission scripts' Redis time beside a trivial script) and bench/bench_hops.py (each hop of the
first-token path beside a bare echo; the engine-stream hops among them)."""

from __future__ import annotations

import json
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import bench_hops  # noqa: E402
import bench_lua_cost  # noqa: E402


def test_the_admission_scripts_are_timed_beside_a_trivial_script(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "lua.json"
    assert bench_lua_cost.main(["--calls", "200", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert set(r) >= {"trivial", "prelude", "enqueue+settle"}
    assert r["trivial"]["commands"] == 0 and r["prelude"]["commands"] == 1        # the prelude reads TIME
    # one request through ENQUEUE's fast path and its SETTLE: dozens of commands, more time than the floor
    assert 20 <= r["enqueue+settle"]["commands"] <= 120
    assert r["enqueue+settle"]["script_us"] > r["prelude"]["script_us"] > r["trivial"]["script_us"] > 0
    # the function library runs the same commands for the same request (only the Lua around them differs)
    assert r["library: enqueue+settle"]["commands"] == r["enqueue+settle"]["commands"]
    assert r["library: x16"]["commands"] == r["enqueue+settle x16"]["commands"]


def test_every_hop_is_measured_with_the_engine_stream_beside_its_floor(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "hops.json"
    assert bench_hops.main(["--calls", "30", "--json", str(out)]) == 0
    hops = json.loads(out.read_text())["hops"]
    assert set(hops) == {"echo", "tok-text-raw", "tok-chat-raw", "tok-chat-coal", "tok-chat-cached", "redis-ping",
                         "echo-bidi", "engine-raw", "engine-mux"}
    for name, s in hops.items():
        assert 0 < s["p50"] <= s["p90"] <= s["p99"], name
