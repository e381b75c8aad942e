"""Recorded traffic as a workload: JSONL rows (one request each) grouped into sessions.

Fields: ``timestamp`` (s; also ``arrival``/``t``), ``prompt_tokens`` (also ``input_tokens``,
``ContextTokens``), ``output_tokens`` (also ``max_tokens``, ``GeneratedTokens``), and optionally
``tenant``, ``priority``, ``class`` and ``session_id``: rows sharing a session id are the turns of
one chat, in order, each sent no earlier than its own timestamp.
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

from .spec import PRIORITY_NAMES, ArrivalSpec, SessionPlan, TenantSpec, TurnPlan, Workload, WorkloadError


def read_jsonl(path: pathlib.Path) -> list[dict[str, Any]]:
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise WorkloadError(f"{path}:{n}: {exc}") from None
    return rows


_ALIASES = {"prompt_tokens": ("prompt_tokens", "input_tokens", "ContextTokens"),
            "output_tokens": ("output_tokens", "max_tokens", "GeneratedTokens"),
            "timestamp": ("timestamp", "arrival", "t")}


def _field(row: Mapping[str, Any], name: str, default: Any = None) -> Any:
    return next((row[a] for a in _ALIASES.get(name, (name,)) if a in row), default)


def trace_sessions(rows: Sequence[Mapping[str, Any]]) -> tuple[SessionPlan, ...]:
    """Group trace rows into sessions (by ``session_id``; a row without one is its own session)."""
    groups: dict[str, list[Mapping[str, Any]]] = {}
    for n, row in enumerate(rows):
        if _field(row, "prompt_tokens") is None or _field(row, "output_tokens") is None:
            raise WorkloadError(f"trace line {n + 1}: needs prompt_tokens and output_tokens")
        groups.setdefault(str(row.get("session_id") or f"#{n}"), []).append(row)
    t0 = min((float(_field(r, "timestamp", 0.0)) for r in rows), default=0.0)
    sessions = []
    for i, (_, turns) in enumerate(sorted(groups.items(), key=lambda kv: float(_field(kv[1][0], "timestamp", 0)))):
        first = turns[0]
        plans = tuple(TurnPlan(int(_field(r, "prompt_tokens")), int(_field(r, "output_tokens")),
                               at=float(_field(r, "timestamp", t0)) - t0) for r in turns)
        priority = str(first.get("priority", "") or "")
        if priority not in PRIORITY_NAMES:
            raise WorkloadError(f"trace: unknown priority {priority!r}")
        sessions.append(SessionPlan(
            index=i, tenant=str(first.get("tenant", "default")), priority=priority,
            cls=str(first.get("class", "trace")), kind="chat" if len(plans) > 1 else "completion",
            turns=plans, start=plans[0].at, seed=i))
    return tuple(sessions)


def load_trace(path: str | os.PathLike[str], *, name: str = "") -> Workload:
    """A JSONL trace replayed at its recorded times."""
    p = pathlib.Path(path)
    sessions = trace_sessions(read_jsonl(p))
    tenants = tuple(TenantSpec(t) for t in sorted({s.tenant for s in sessions}))
    span = max((s.turns[-1].at or 0.0 for s in sessions), default=0.0)
    return Workload(name=name or p.stem, description=f"trace replay of {p.name}", tenants=tenants,
                    arrival=ArrivalSpec(mode="trace"), trace=sessions, duration=span + 1.0)
