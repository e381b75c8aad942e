"""The tokenizer bench (bench/bench_tokenizer.py): its core splitting, and a short real run (the
service and the raw encoder as processes, the router's client, a tokenizer trained in the test,
synthetic text), so the script that produces docs/benchmarks.md keeps working."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

from tests.scripts import load_script
from tests.tiny_model import build_tokenizer

REPO = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "bench_tokenizer.py"


bench = load_script("bench_tokenizer")


def test_core_lists_and_splits() -> None:
    assert bench.parse_cpus("0-3,8") == {0, 1, 2, 3, 8}
    assert bench.split_cpus({0, 1}) == ({1}, {0})
    assert bench.split_cpus(set(range(16))) == (set(range(8, 16)), set(range(8)))
    assert bench.split_cpus({5}) == ({5}, {5})          # one core: nothing to split
    assert bench.split_groups(set(range(8, 16)), 3) == [{8, 9, 10}, {11, 12}, {13, 14, 15}]
    assert bench.split_groups(None, 2) == [None, None]


def test_short_run_reports_every_mode(tmp_path: pathlib.Path) -> None:
    build_tokenizer(tmp_path / "tok")
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"word{i % 97} and some more text number {i}." for i in range(3000)))
    out = tmp_path / "result.json"
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--tokenizer", str(tmp_path / "tok" / "tokenizer.json"), "--text", str(text),
         "--sizes", "64", "--clients", "4", "--seconds", "0.4", "--rounds", "1", "--detok-requests", "4",
         "--detok-tokens", "8", "--repeats", "1", "--json-out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=180, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(out.read_text())
    rows = {(r["mode"], r["clients"]): r for r in result["tokenize"]}
    assert set(rows) == {("direct", 1), ("direct", 4), ("coalesced", 4)}
    for row in rows.values():
        assert row["requests"] > 0 and row["service_tok_s"] > 0 and row["raw_tok_s"] > 0
        assert 50 <= row["prompt_tokens"] <= 80 and row["ratio"] == row["ratio"]   # not NaN
    assert [d["mode"] for d in result["detokenize"]] == ["stream per request", "multiplexed"]
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) > 1:   # service and raw encoder share their cores, the client has the others
        assert set(result["service_cpus"]).isdisjoint(result["client_cpus"])
    assert "coalesced" in run.stdout and "ratio" in run.stdout
