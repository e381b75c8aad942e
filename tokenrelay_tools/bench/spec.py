"""The workload model: frozen dataclasses for distributions, arrivals, tenants, request classes,
and the session plans sampled from them (no I/O here; `workload` loads and samples, `trace` reads
recorded traffic)."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, replace
from typing import Any

PRIORITY_NAMES = ("", "low", "normal", "high")


class WorkloadError(ValueError):
    """A workload file or spec is malformed (the message names the field)."""


@dataclass(frozen=True)
class Dist:
    """A distribution of non-negative numbers, clamped to [min, max].

    kinds: constant (value), uniform (min..max), lognormal (median, sigma of the log),
    normal (mean, sigma), exponential (mean), choice (values, optional weights; or ``file`` +
    ``field``: the values of that field in a JSONL trace, i.e. lengths sampled from a trace).
    """

    kind: str = "constant"
    value: float = 0.0
    min: float = 0.0
    max: float = math.inf
    median: float = 1.0
    mean: float = 1.0
    sigma: float = 0.0
    values: tuple[float, ...] = ()
    weights: tuple[float, ...] = ()

    def sample(self, rng: random.Random) -> float:
        if self.kind == "constant":
            x = self.value
        elif self.kind == "uniform":
            x = rng.uniform(self.min, self.max)
        elif self.kind == "lognormal":
            x = rng.lognormvariate(math.log(self.median), self.sigma)
        elif self.kind == "normal":
            x = rng.gauss(self.mean, self.sigma)
        elif self.kind == "exponential":
            x = rng.expovariate(1.0 / self.mean) if self.mean > 0 else 0.0
        else:  # choice
            x = rng.choices(self.values, weights=self.weights or None)[0]
        return min(max(x, self.min), self.max)

    def sample_int(self, rng: random.Random, scale: float = 1.0) -> int:
        return max(1, round(self.sample(rng) * scale))

    @property
    def upper(self) -> float:
        """The largest value this distribution can produce."""
        if self.kind == "constant":
            return min(max(self.value, self.min), self.max)
        if self.kind == "choice":
            return min(max(self.values), self.max)
        return self.max


@dataclass(frozen=True)
class Burst:
    """Extra arrival rate ``rate`` during [start, start + duration), repeated every ``every`` s."""

    start: float
    duration: float
    rate: float
    every: float = 0.0


@dataclass(frozen=True)
class ArrivalSpec:
    mode: str = "poisson"           # poisson | constant | closed | trace
    rate: float = 1.0               # sessions per second (open loop)
    concurrency: int = 4            # sessions running at once (closed loop)
    bursts: tuple[Burst, ...] = ()
    time_scale: float = 1.0         # trace: multiply recorded timestamps (0.5 = twice as fast)


@dataclass(frozen=True)
class RequestClass:
    name: str
    kind: str = "completion"        # completion | chat
    weight: float = 1.0
    turns: Dist = field(default_factory=lambda: Dist("constant", value=1))
    prompt_tokens: Dist = field(default_factory=lambda: Dist("constant", value=128))
    output_tokens: Dist = field(default_factory=lambda: Dist("constant", value=64))
    system_tokens: int = 0          # chat: a system prompt at the start of the session
    shared_system: bool = False     # the system prompt is the same for every session (cacheable)
    think_time: Dist = field(default_factory=Dist)  # chat: seconds between a reply and the next turn


@dataclass(frozen=True)
class TenantSpec:
    name: str
    weight: float = 1.0             # the tenant's share of the arrivals
    fairness_weight: float | None = None   # its share of the service it is owed (the report's Jain index)
    priorities: tuple[tuple[str, float], ...] = (("", 1.0),)
    classes: tuple[tuple[str, float], ...] = ()   # empty = every class at its own weight


@dataclass(frozen=True)
class TurnPlan:
    prompt_tokens: int              # new tokens this turn (the user message; the whole prompt if single)
    output_tokens: int
    think_time: float = 0.0         # wait after the previous turn's reply
    at: float | None = None         # trace replay: not before this offset from the run start


@dataclass(frozen=True)
class SessionPlan:
    index: int
    tenant: str
    priority: str
    cls: str
    kind: str
    turns: tuple[TurnPlan, ...]
    system_tokens: int = 0
    shared_system: bool = False
    seed: int = 0
    start: float | None = None      # trace replay: arrival offset


@dataclass(frozen=True)
class Workload:
    name: str
    description: str = ""
    seed: int = 0
    arrival: ArrivalSpec = field(default_factory=ArrivalSpec)
    tenants: tuple[TenantSpec, ...] = (TenantSpec("default"),)
    classes: tuple[RequestClass, ...] = (RequestClass("default"),)
    unique_prompts: bool = True     # start each session with a nonce so prefix caches cannot hit across sessions
    duration: float = 60.0          # default bounds; the command line overrides them
    requests: int = 0
    trace: tuple[SessionPlan, ...] = ()

    def with_arrival(self, **changes: Any) -> Workload:
        return replace(self, arrival=replace(self.arrival, **changes))
