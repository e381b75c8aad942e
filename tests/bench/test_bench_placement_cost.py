"""bench/bench_placement_cost.py runs and prints one row per hold count, the baseline first."""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))

import bench_placement_cost


def test_it_prints_the_baseline_and_ratios(monkeypatch, capsys) -> None:
    monkeypatch.setattr(sys, "argv", ["x", "--holds", "20", "--decisions", "40", "--repeats", "1", "--replicas", "3"])
    bench_placement_cost.main()
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert [r[0] for r in rows] == ["0", "20"]
    assert rows[0][2] == "1.00" and float(rows[1][1]) > 0 and float(rows[1][3]) > 0
