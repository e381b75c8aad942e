"""Open-loop arrival times: Poisson or evenly spaced at a base rate, plus bursts of extra rate.

The rate is piecewise constant (the base rate plus every burst active at that moment), so a
Poisson process is drawn exactly: exponential gaps at the current rate, restarted at each rate
change (memorylessness makes the restart free of bias). Closed-loop runs need no arrival times:
the runner keeps ``concurrency`` sessions running instead.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator

from .workload import ArrivalSpec, Burst

# Rate changes closer than this are merged, so float error at a boundary cannot stall the loop.
_EPS = 1e-9


def _active(b: Burst, t: float) -> bool:
    if t < b.start:
        return False
    if b.every <= 0:
        return t < b.start + b.duration
    return (t - b.start) % b.every < b.duration


def rate_at(spec: ArrivalSpec, t: float) -> float:
    """Sessions per second at offset ``t`` (base rate plus active bursts)."""
    return spec.rate + sum(b.rate for b in spec.bursts if _active(b, t))


def _burst_next_change(b: Burst, t: float) -> float:
    if t < b.start:
        return b.start
    if b.every <= 0:
        end = b.start + b.duration
        return end if t < end else math.inf
    k = math.floor((t - b.start) / b.every)
    phase = b.start + k * b.every
    end = phase + b.duration
    return end if t < end else phase + b.every


def next_change(spec: ArrivalSpec, t: float) -> float:
    """The first offset after ``t`` where the rate may change (inf when it never does)."""
    return min((_burst_next_change(b, t + _EPS) for b in spec.bursts), default=math.inf)


def open_loop_times(spec: ArrivalSpec, rng: random.Random, horizon: float = math.inf) -> Iterator[float]:
    """Arrival offsets (seconds from the start) in increasing order, all below ``horizon``."""
    poisson = spec.mode == "poisson"
    t = 0.0
    first = True
    while t < horizon:
        rate = rate_at(spec, t)
        change = next_change(spec, t)
        if rate <= 0:
            if math.isinf(change):
                return
            t = change
            continue
        if not poisson and first:
            # Evenly spaced arrivals start at once rather than one gap in.
            first = False
            yield t
            continue
        gap = rng.expovariate(rate) if poisson else 1.0 / rate
        if t + gap >= change:
            t = change
            continue
        t += gap
        if t < horizon:
            yield t


def mean_rate(spec: ArrivalSpec, horizon: float) -> float:
    """Average sessions per second over [0, horizon) (for the report and progress estimates)."""
    if horizon <= 0 or math.isinf(horizon):
        return spec.rate
    t, total = 0.0, 0.0
    while t < horizon:
        end = min(next_change(spec, t), horizon)
        total += rate_at(spec, t) * (end - t)
        t = end
    return total / horizon
