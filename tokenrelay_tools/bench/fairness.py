"""Fairness of a run between tenants: served tokens per tenant and Jain's index over them, weighted.

Served tokens are prompt + completion tokens: of the successful requests (``served_ok``), and of all
requests (``served_all``: a failed request counts what it was served before it failed — the tokens
streamed, and its planned prompt once its first token came). ``offered`` is what the tenant asked
for (planned prompt + planned output of every request it sent), to tell an unfair split from a
tenant that simply asked for less.

Jain's index over x_i = served_i / weight_i is (Σx)² / (n·Σx²): 1 when every tenant got the same
tokens per unit of weight, 1/n when one got everything. It says something about the scheduler
only when every tenant counted was backlogged (offered at least its share); the tenants counted
are those that sent a request. Weights: ``--tenant-weight NAME=W``, else the workload's
``fairness_weight`` of the tenant, else 1. (A workload tenant's ``weight`` is its share of the
*arrivals*, not of the service it is owed, so it is never used here.)
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .runner import RequestRecord
from .spec import Workload


class WeightError(ValueError):
    """A `--tenant-weight` value is malformed (the message names it)."""


def parse_tenant_weights(items: Iterable[str]) -> dict[str, float]:
    """`--tenant-weight NAME=W` values (repeatable; a later one for the same name wins)."""
    out: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition("=")
        try:
            weight = float(value)
        except ValueError:
            weight = math.nan
        if not sep or not name or not math.isfinite(weight) or weight <= 0:
            raise WeightError(f"--tenant-weight {item!r}: expected NAME=W with a weight > 0")
        out[name] = weight
    return out


def tenant_weights(workload: Workload | None, flags: Mapping[str, float]) -> dict[str, float]:
    """The weights that apply: the workload's `fairness_weight`s, overridden by the flags."""
    out = {t.name: t.fairness_weight for t in (workload.tenants if workload else ()) if t.fairness_weight}
    out.update(flags)
    return out


def jain_index(values: Sequence[float]) -> float | None:
    """(Σx)² / (n·Σx²); None when there is nothing to compare (no values, or all zero)."""
    squares = math.fsum(x * x for x in values)
    if not values or squares == 0:
        return None
    return math.fsum(values) ** 2 / (len(values) * squares)


def served_tokens(records: Iterable[RequestRecord]) -> dict[str, dict[str, int]]:
    """Per tenant (sorted): requests, served_ok, served_all, offered tokens."""
    out: dict[str, dict[str, int]] = {}
    for r in records:
        t = out.setdefault(r.tenant, {"requests": 0, "served_ok": 0, "served_all": 0, "offered": 0})
        served = r.prompt_tokens + r.completion_tokens
        t["requests"] += 1
        t["served_all"] += served
        t["served_ok"] += served if r.ok else 0
        t["offered"] += r.planned_prompt_tokens + r.planned_output_tokens
    return dict(sorted(out.items()))


def fairness_report(records: Sequence[RequestRecord], weights: Mapping[str, float] | None = None) -> dict[str, Any]:
    """Served tokens, shares and weights per tenant, and Jain's index over weighted served tokens."""
    weights = weights or {}
    served = served_tokens(records)
    total_ok = sum(t["served_ok"] for t in served.values())
    total_all = sum(t["served_all"] for t in served.values())
    tenants: dict[str, Any] = {}
    for name, t in served.items():
        w = float(weights.get(name, 1.0))
        tenants[name] = {**t, "weight": w, "share_ok": t["served_ok"] / total_ok if total_ok else 0.0,
                         "share_all": t["served_all"] / total_all if total_all else 0.0,
                         "served_ok_per_weight": t["served_ok"] / w, "served_all_per_weight": t["served_all"] / w}
    return {"jain_ok": jain_index([t["served_ok_per_weight"] for t in tenants.values()]),
            "jain_all": jain_index([t["served_all_per_weight"] for t in tenants.values()]),
            "tenants": tenants}
