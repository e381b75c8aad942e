"""Workloads as data: YAML/JSON loading, the named workloads, and seeded sampling of sessions.

A workload is a mix of *request classes* (a one-shot completion, a multi-turn chat, a long
document, ...) sent by weighted *tenants* in priority classes, with arrivals described by an
`ArrivalSpec`. Sampling is deterministic for a seed: `SessionSampler(workload, seed)` yields the
same `SessionPlan`s whatever the target or the arrival mode, which is what lets `--compare` run
one workload against two targets.

    name: chat-multiturn
    arrival: {mode: poisson, rate: 4}
    tenants: [{name: app, weight: 1, priorities: {normal: 1}}]
    classes:
      - name: chat
        kind: chat
        turns: {dist: uniform, min: 2, max: 5}
        prompt_tokens: {dist: lognormal, median: 60, sigma: 0.5, min: 8, max: 400}
        output_tokens: {dist: lognormal, median: 40, sigma: 0.4, min: 4, max: 200}
        system_tokens: 40

A tenant's ``weight`` is its share of the arrivals; ``fairness_weight`` (default 1) is its share
of the service it is owed, which the report's Jain index weighs served tokens by (`fairness`).

A JSONL trace replays recorded traffic instead: one request per line with ``timestamp`` (s),
``prompt_tokens``, ``output_tokens`` and optionally ``tenant``, ``priority``, ``class`` and
``session_id`` (lines sharing a session id are the turns of one chat, in order).
"""

from __future__ import annotations

import json
import math
import pathlib
import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

import yaml

from tokenrelay_tools import env

from .spec import (
    PRIORITY_NAMES,
    ArrivalSpec,
    Burst,
    Dist,
    RequestClass,
    SessionPlan,
    TenantSpec,
    TurnPlan,
    Workload,
    WorkloadError,
)
from .trace import load_trace, read_jsonl, trace_sessions

__all__ = ["PRIORITY_NAMES", "ArrivalSpec", "Burst", "Dist", "RequestClass", "SessionPlan", "SessionSampler",
           "TenantSpec", "TurnPlan", "Workload", "WorkloadError", "available_workloads", "load_trace",
           "load_workload", "parse_dist", "parse_workload", "trace_sessions"]

# Shipped inside the package (package-data), so a non-editable install has them too.
_REPO_WORKLOADS = pathlib.Path(__file__).resolve().parent / "workloads"


_DIST_KINDS = {"constant", "uniform", "lognormal", "normal", "exponential", "choice"}


def parse_dist(spec: Any, where: str, base_dir: pathlib.Path | None = None) -> Dist:
    if isinstance(spec, (int, float)) and not isinstance(spec, bool):
        return Dist("constant", value=float(spec))
    if not isinstance(spec, Mapping):
        raise WorkloadError(f"{where}: expected a number or a mapping with `dist`, got {spec!r}")
    s = dict(spec)
    kind = s.pop("dist", "constant")
    if kind not in _DIST_KINDS:
        raise WorkloadError(f"{where}: unknown dist {kind!r} (one of {sorted(_DIST_KINDS)})")
    if kind == "choice" and "file" in s:
        path = pathlib.Path(s.pop("file"))
        path = path if path.is_absolute() or base_dir is None else base_dir / path
        name = s.pop("field", "prompt_tokens")
        s["values"] = [float(r[name]) for r in read_jsonl(path) if name in r]
    try:
        for key in ("values", "weights"):
            if key in s:
                s[key] = tuple(float(v) for v in s[key])
        fields: dict[str, Any] = {k: v if k in ("values", "weights") else float(v) for k, v in s.items()}
        d = Dist(kind, **fields)
    except (TypeError, ValueError) as exc:
        raise WorkloadError(f"{where}: {exc}") from None
    if kind == "choice" and not d.values:
        raise WorkloadError(f"{where}: choice needs `values` (or a `file` with that field)")
    if kind == "lognormal" and d.median <= 0:
        raise WorkloadError(f"{where}: lognormal needs median > 0")
    if d.min > d.max:
        raise WorkloadError(f"{where}: min > max")
    if kind == "uniform" and math.isinf(d.max):
        raise WorkloadError(f"{where}: uniform needs a finite `max`")
    return d


def _weights(spec: Any, where: str, allowed: Sequence[str] | None = None) -> tuple[tuple[str, float], ...]:
    if isinstance(spec, str):
        spec = {spec: 1.0}
    if not isinstance(spec, Mapping) or not spec:
        raise WorkloadError(f"{where}: expected a non-empty mapping name -> weight")
    out = []
    for key, w in spec.items():
        key = "" if key in (None, "default") else str(key)
        if allowed is not None and key not in allowed:
            raise WorkloadError(f"{where}: unknown name {key!r} (one of {sorted(allowed)})")
        if float(w) < 0:
            raise WorkloadError(f"{where}: negative weight for {key!r}")
        out.append((key, float(w)))
    if sum(w for _, w in out) <= 0:
        raise WorkloadError(f"{where}: weights sum to zero")
    return tuple(out)


def _parse_class(spec: Mapping[str, Any], base: pathlib.Path | None) -> RequestClass:
    s = dict(spec)
    name = str(s.pop("name", "") or "")
    if not name:
        raise WorkloadError("classes: every class needs a `name`")
    where = f"classes.{name}"
    dists: dict[str, Any] = {k: parse_dist(s.pop(k), f"{where}.{k}", base)
                             for k in ("turns", "prompt_tokens", "output_tokens", "think_time") if k in s}
    kind = s.pop("kind", None) or ("chat" if dists.get("turns", Dist(value=1)).upper > 1 else "completion")
    if kind not in ("completion", "chat"):
        raise WorkloadError(f"{where}.kind: completion | chat, got {kind!r}")
    try:
        return RequestClass(name=name, kind=kind, **dists, **s)
    except TypeError as exc:
        raise WorkloadError(f"{where}: {exc}") from None


def _parse_arrival(spec: Mapping[str, Any]) -> ArrivalSpec:
    s = dict(spec)
    bursts = tuple(Burst(**b) for b in s.pop("bursts", []) or [])
    try:
        a = ArrivalSpec(bursts=bursts, **s)
    except TypeError as exc:
        raise WorkloadError(f"arrival: {exc}") from None
    if a.mode not in ("poisson", "constant", "closed", "trace"):
        raise WorkloadError(f"arrival.mode: poisson | constant | closed | trace, got {a.mode!r}")
    if a.mode in ("poisson", "constant") and a.rate <= 0:
        raise WorkloadError("arrival.rate must be > 0")
    if a.mode == "closed" and a.concurrency < 1:
        raise WorkloadError("arrival.concurrency must be >= 1")
    return a


def parse_workload(spec: Mapping[str, Any], *, name: str = "", base_dir: pathlib.Path | None = None) -> Workload:
    """Build a `Workload` from a decoded YAML/JSON mapping (see the module docstring)."""
    s = dict(spec)
    classes = tuple(_parse_class(c, base_dir) for c in s.pop("classes", [{"name": "default"}]))
    names = [c.name for c in classes]
    if len(set(names)) != len(names):
        raise WorkloadError("classes: duplicate class names")
    tenants = []
    for t in s.pop("tenants", [{"name": "default"}]):
        t = dict(t)
        tname = str(t.pop("name", ""))
        where = f"tenants.{tname}"
        if not tname:
            raise WorkloadError("tenants: every tenant needs a `name`")
        prios = _weights(t.pop("priorities", {"": 1.0}), f"{where}.priorities", PRIORITY_NAMES)
        mix = _weights(t.pop("classes"), f"{where}.classes", names) if "classes" in t else ()
        fair = t.pop("fairness_weight", None)
        if fair is not None and (isinstance(fair, bool) or not isinstance(fair, (int, float))
                                 or not math.isfinite(fair) or fair <= 0):
            raise WorkloadError(f"{where}.fairness_weight: expected a number > 0, got {fair!r}")
        tenants.append(TenantSpec(tname, float(t.pop("weight", 1.0)), None if fair is None else float(fair),
                                  prios, mix))
        if t:
            raise WorkloadError(f"{where}: unknown keys {sorted(t)}")
    arrival = _parse_arrival(s.pop("arrival", {}) or {})
    trace: tuple[SessionPlan, ...] = ()
    if "trace" in s:
        path = pathlib.Path(s.pop("trace"))
        trace = trace_sessions(read_jsonl(path if path.is_absolute() or base_dir is None else base_dir / path))
        arrival = replace(arrival, mode="trace") if arrival.mode != "closed" else arrival
    try:
        return Workload(name=str(s.pop("name", name) or name), classes=classes, tenants=tuple(tenants),
                        arrival=arrival, trace=trace, **s)
    except TypeError as exc:
        raise WorkloadError(f"workload: {exc}") from None


def workload_dirs() -> list[pathlib.Path]:
    return [*env.bench_workload_dirs(), _REPO_WORKLOADS]


def available_workloads() -> dict[str, pathlib.Path]:
    found: dict[str, pathlib.Path] = {}
    for d in workload_dirs():
        for p in sorted(d.glob("*.y*ml")) if d.is_dir() else []:
            found.setdefault(p.stem, p)
    return found


def load_workload(name_or_path: str) -> Workload:
    """A named workload (tokenrelay_tools/bench/workloads/<name>.yaml), a YAML/JSON file, or a JSONL trace."""
    p = pathlib.Path(name_or_path)
    if p.suffix == ".jsonl":
        return load_trace(p)
    if not p.exists():
        named = available_workloads()
        if name_or_path not in named:
            raise WorkloadError(f"unknown workload {name_or_path!r}: not a file, and not one of "
                                f"{sorted(named)}")
        p = named[name_or_path]
    text = p.read_text()
    try:
        data = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        raise WorkloadError(f"{p}: {exc}") from None
    if not isinstance(data, Mapping):
        raise WorkloadError(f"{p}: expected a mapping at the top level")
    return parse_workload(data, name=p.stem, base_dir=p.parent)


# ----------------------------------------------------------------------------------- sampling
class SessionSampler:
    """Seeded, infinite (or, for a trace, finite) stream of `SessionPlan`s.

    ``length_scale`` multiplies every sampled token length (fit a workload meant for long
    contexts onto a small model).
    """

    def __init__(self, workload: Workload, seed: int | None = None, length_scale: float = 1.0) -> None:
        self.workload = workload
        self.seed = workload.seed if seed is None else seed
        self.length_scale = length_scale
        self._rng = random.Random(self.seed)
        self._classes = {c.name: c for c in workload.classes}
        self._count = 0

    def __iter__(self) -> Iterator[SessionPlan]:
        if self.workload.trace:
            for s in self.workload.trace:
                yield self._scaled(s)
            return
        while True:
            yield self.next()

    def _scaled(self, s: SessionPlan) -> SessionPlan:
        if self.length_scale == 1.0:
            return s
        k = self.length_scale
        return replace(s, turns=tuple(replace(t, prompt_tokens=max(1, round(t.prompt_tokens * k)),
                                              output_tokens=max(1, round(t.output_tokens * k))) for t in s.turns))

    def next(self) -> SessionPlan:
        rng, w = self._rng, self.workload
        tenant = rng.choices(w.tenants, weights=[t.weight for t in w.tenants])[0]
        names, weights = zip(*tenant.priorities, strict=True)
        priority = rng.choices(names, weights=weights)[0]
        if tenant.classes:
            cnames, cweights = zip(*tenant.classes, strict=True)
            cls = self._classes[rng.choices(cnames, weights=cweights)[0]]
        else:
            cls = rng.choices(w.classes, weights=[c.weight for c in w.classes])[0]
        n_turns = round(cls.turns.sample(rng)) if cls.kind == "chat" else 1
        k = self.length_scale
        turns = tuple(TurnPlan(cls.prompt_tokens.sample_int(rng, k), cls.output_tokens.sample_int(rng, k),
                               cls.think_time.sample(rng) if i else 0.0) for i in range(max(1, n_turns)))
        index = self._count
        self._count += 1
        system = max(0, round(cls.system_tokens * k)) if cls.system_tokens else 0
        return SessionPlan(index=index, tenant=tenant.name, priority=priority, cls=cls.name, kind=cls.kind,
                           turns=turns, system_tokens=system, shared_system=cls.shared_system,
                           seed=rng.getrandbits(63))
