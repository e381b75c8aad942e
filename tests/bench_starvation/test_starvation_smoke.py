"""The starvation bench (bench/bench_starvation.py): its analysis on constructed timelines, its
workload, and a short end-to-end run against the monolith and a two-replica mesh as real
processes. Nothing here needs ../shared/data: the tokenizer is trained in the test and the text
is the script's synthetic one."""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import subprocess
import sys
import time

import pytest
from tokenizers import Tokenizer

from tests.scripts import load_script
from tests.tiny_model import build_tokenizer

REPO = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "bench_starvation.py"


bench = load_script("bench_starvation")


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A byte-level BPE built here, as a lone tokenizer.json: the tiny model's tokenizer_config
    declares a 512-token context, which would (rightly) reject the bench's long prompts."""
    built = tmp_path_factory.mktemp("tok")
    build_tokenizer(built)
    alone = tmp_path_factory.mktemp("tok-only") / "tokenizer.json"
    alone.write_bytes((built / "tokenizer.json").read_bytes())
    return alone


def _record(sent: float, handed: float) -> object:
    rec = bench.Record(tokens=100, sent=sent, handed=handed)
    rec.ended = handed + 1
    return rec


def test_idle_breakdown_on_a_constructed_timeline() -> None:
    # Engine load as a step function: empty until 1.0, a request queued 1.0-1.2, running to 3.0,
    # then empty again. Three requests: one waits upstream 0.5-1.0 while the engine is empty; one
    # waits 1.5-2.0 while the engine runs with nothing queued; one waits 2.5-3.5 across the end of
    # the running request.
    samples = [(0.0, 0, 0, 0, math.nan), (1.0, 0, 1, 0, math.nan), (1.2, 1, 0, 100, math.nan),
               (3.0, 0, 0, 100, math.nan)]
    records = [_record(0.5, 1.0), _record(1.5, 2.0), _record(2.5, 3.5)]
    out = bench.idle_breakdown(samples, records, 0.0, 4.0)
    assert out["empty_s"] == pytest.approx(1.0 + 1.0)             # [0, 1) and [3, 4)
    assert out["idle_starved_s"] == pytest.approx(0.5 + 0.5)      # [0.5, 1) and [3, 3.5)
    # ... plus the waits while the engine ran with nothing queued: [1.5, 2) and [2.5, 3).
    assert out["prefill_starved_s"] == pytest.approx(out["idle_starved_s"] + 0.5 + 0.5)
    # The window clips: only what falls inside [a, b] counts.
    clipped = bench.idle_breakdown(samples, records, 0.75, 1.1)
    assert clipped["idle_starved_s"] == pytest.approx(0.25)
    assert clipped["empty_s"] == pytest.approx(0.25)


def test_percentile_interpolates() -> None:
    values = [float(v) for v in range(1, 101)]
    assert bench.percentile(values, 50) == pytest.approx(50.5)
    assert bench.percentile(values, 99) == pytest.approx(99.01)
    assert bench.percentile([3.0], 90) == 3.0 and math.isnan(bench.percentile([], 50))


def test_workload_is_long_unique_and_poisson(tokenizer_json: pathlib.Path) -> None:
    tok = Tokenizer.from_file(str(tokenizer_json))
    args = argparse.Namespace(seed=3, min_prompt_tokens=200, max_prompt_tokens=800, prefill_us=18.0,
                              max_tokens=16, rate=0.0, load=1.0, duration=4.0)
    text = bench.synthetic_text(50_000, seed=3)
    w = bench.build_workload(tok, text, args)
    # Offered at `load` x the engine's estimated capacity, for `duration` seconds.
    assert w.rate == pytest.approx(w.capacity)
    assert 0.5 * w.rate * args.duration < len(w.arrivals) < 1.5 * w.rate * args.duration
    assert all(0 < a < args.duration for a in w.arrivals) and w.arrivals == sorted(w.arrivals)
    for prompt, n in zip(w.prompts, w.tokens, strict=True):
        assert args.min_prompt_tokens <= n <= args.max_prompt_tokens
        # A cut at token boundaries re-encodes to (almost) the intended length.
        assert abs(len(tok.encode(prompt, add_special_tokens=False).ids) - n) <= 2
    # Unique prefixes: no two prompts share a first prefix-cache block (32 tokens).
    heads = {tuple(tok.encode(p, add_special_tokens=False).ids[:32]) for p in w.prompts}
    assert len(heads) == len(w.prompts)


def test_capacity_follows_the_prefill_cost() -> None:
    slow = bench.engine_capacity(16_000, 18e-6, 64)
    fast = bench.engine_capacity(16_000, 2e-6, 64)
    assert 2.5 < slow < 3.5      # ~1 / (16k x 18 us): one H200's prefill
    assert fast > 5 * slow


def test_the_bench_runs_against_the_monolith_and_a_mesh(tmp_path: pathlib.Path,
                                                         tokenizer_json: pathlib.Path) -> None:
    out = tmp_path / "result.json"
    env = {**os.environ, "TOKENRELAY_SHARED_DATA": str(tmp_path / "no-data")}  # the fresh-machine path
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--systems", "monolith,mesh2", "--tokenizer", str(tokenizer_json),
         "--duration", "2", "--rate", "10", "--min-prompt-tokens", "300", "--max-prompt-tokens", "1500",
         "--max-tokens", "8", "--drain-timeout", "30", "--work-dir", str(tmp_path / "work"), "--json", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert time.monotonic() - t0 < 120
    result = json.loads(out.read_text())
    assert result["config"]["text"] == "synthetic"
    rows = {row["system"]: row for row in result["systems"]}
    assert list(rows) == ["monolith", "mesh2"]
    assert "starved:idle" in proc.stdout and "mesh2" in proc.stdout
    for name, row in rows.items():
        assert row["sent"] == result["config"]["requests"] > 0, name
        assert row["with_first_token"] == row["sent"] and row["errors"] == {}, (name, row["errors"])
        assert 0 < row["ttft_p50_s"] <= row["ttft_p90_s"] <= row["ttft_p99_s"] < 30, name
        assert row["window_s"] == pytest.approx(2.0)
        assert 0 < row["busy_fraction"] <= 1.05, name
        assert 0 <= row["idle_starved_s"] <= row["empty_s"] <= row["window_s"], name
        assert row["idle_starved_s"] <= row["prefill_starved_s"] <= row["window_s"], name
        # A light load: the engine admits about what was offered, and no prompt hit the prefix cache.
        assert 0.5 * row["offered_prompt_tokens_per_s"] < row["prompt_tokens_per_s"], name
        assert row["prompt_tokens_per_s"] < 1.5 * row["offered_prompt_tokens_per_s"], name
        assert row["cached_tokens"] == 0, name
        assert row["load_samples"] > row["window_s"] / result["config"]["sample_interval"] / 4, name
    assert set(rows["monolith"]["cpu_cores"]) == {"bench", "monolith", "other"}
    assert set(rows["mesh2"]["cpu_cores"]) == {"bench", "redis", "tokenizer", "tokenizer1", "engine", "router",
                                               "other"}
    for row in rows.values():  # CPU is counted in clock ticks: an idle Redis may show 0
        ours = {name: cores for name, cores in row["cpu_cores"].items() if name != "other"}
        assert all(0 <= cores <= (os.cpu_count() or 1) for cores in ours.values()), ours
        assert ours["bench"] > 0 and ours.get("monolith", ours.get("engine", 0)) > 0, ours
    assert rows["mesh2"]["tokenize_p50_ms"] > 0
