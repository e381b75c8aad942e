"""bench/bench_fairness.py end to end, tiny: a real mesh (redis-server, tokenizer, one sim engine,
one router), every scenario for well under a second each; the tables and the JSON are complete.
The figures of so short a run mean nothing; only that each is measured and judged."""

from __future__ import annotations

import json
import math
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import bench_fairness  # noqa: E402
from fairness_load import jain, percentile  # noqa: E402


def test_statistics() -> None:
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.0 and percentile([1.0, math.inf], 99) == math.inf
    assert math.isnan(percentile([], 50))
    assert jain([5.0, 5.0, 5.0]) == 1.0 and abs(jain([1.0, 0.0]) - 0.5) < 1e-9


def test_every_scenario_runs_and_prints_its_table(tmp_path: pathlib.Path, capsys) -> None:
    out = tmp_path / "fair.json"
    assert bench_fairness.main(["--seconds", "0.6", "--warmup", "0.3", "--tail", "0.5", "--batch", "4",
                                "--time-scale", "2", "--max-tokens", "8", "--prompt-tokens", "16",
                                "--clients", "0", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    for title in bench_fairness.SCENARIOS:
        assert f"## {title})" in text
    assert "| target | measured | wanted | result |" in text and " PASS, " in text
    doc = json.loads(out.read_text())
    assert set(doc["scenarios"]) == {"a", "b", "c", "d"} and doc["capacity"] == 4
    for res in doc["scenarios"].values():
        assert res["checks"] and all(c["status"] in ("PASS", "MISS", "info") for c in res["checks"])
    a, b, d = doc["scenarios"]["a"], doc["scenarios"]["b"], doc["scenarios"]["d"]
    assert [r["tenant"] for r in a["rows"]] == ["quiet1", "quiet2", "quiet3", "noisy"]
    assert all(r["served_tok_s"] > 0 for r in a["rows"] + b["rows"])
    assert d["capacity_tok_s"] > 0 and d["requests"] > 0
