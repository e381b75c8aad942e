"""bench/refusal_breakdown.py over spans written by hand: which spans make a refusal's phases."""

from __future__ import annotations

import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))

from refusal_breakdown import main, refusals

MS = 1_000_000


def _span(trace: str, name: str, start: float, end: float, status: str = "UNSET",
          service: str = "router_svc") -> dict[str, object]:
    return {"trace_id": trace, "name": name, "service": service, "start": int(start * MS),
            "end": int(end * MS), "status": status}


def test_a_refusal_splits_into_handler_enqueue_and_wait(tmp_path: pathlib.Path, capsys) -> None:
    spans = [
        # a budget refusal: ENQUEUE on the estimate 1-3 ms, asked again 6-7 ms, Tokenize 0.5-6 ms
        _span("a", "tokenrelay.generate", 0, 8, "ERROR"), _span("a", "queue_wait", 1, 3, "ERROR"),
        _span("a", "tokenize", 0.5, 6), _span("a", "queue_wait", 6, 7, "ERROR"),
        # refused by authentication: no queue_wait, not an admission refusal
        _span("b", "tokenrelay.generate", 0, 1, "ERROR"),
        # granted: the root is not an error
        _span("c", "tokenrelay.generate", 0, 50), _span("c", "queue_wait", 1, 2),
    ]
    path = tmp_path / "spans.jsonl"
    path.write_text("".join(json.dumps(s) + "\n" for s in spans))
    (row,) = refusals(str(path))
    assert row["total"] == 8 and row["->enqueue"] == 1 and row["enqueue"] == 3
    assert row["enqueue->end"] == 1 and row["tokenize"] == 5.5 and row["enqueues"] == 2
    assert main([str(path)]) == 0
    assert "1 refusals by admission" in capsys.readouterr().out
