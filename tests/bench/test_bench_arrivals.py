"""Open-loop arrivals: Poisson statistics, even spacing, one-off and periodic bursts."""

from __future__ import annotations

import itertools
import math
import random
import statistics

import pytest

from tokenrelay_tools.bench.arrivals import mean_rate, open_loop_times, rate_at
from tokenrelay_tools.bench.workload import ArrivalSpec, Burst


def test_poisson_arrivals_have_the_target_rate_and_exponential_gaps() -> None:
    spec = ArrivalSpec(mode="poisson", rate=20.0)
    times = list(open_loop_times(spec, random.Random(3), horizon=500.0))
    expected = 20.0 * 500.0
    assert abs(len(times) - expected) < 5 * math.sqrt(expected)  # 5 sigma of a Poisson count
    assert times == sorted(times) and times[-1] < 500.0
    gaps = [b - a for a, b in itertools.pairwise(times)]
    # Exponential gaps: mean 1/rate and coefficient of variation 1 (a constant process has 0).
    assert statistics.mean(gaps) == pytest.approx(0.05, rel=0.05)
    assert statistics.stdev(gaps) / statistics.mean(gaps) == pytest.approx(1.0, rel=0.05)


def test_constant_arrivals_are_evenly_spaced_from_zero() -> None:
    times = list(open_loop_times(ArrivalSpec(mode="constant", rate=4.0), random.Random(), horizon=2.0))
    assert len(times) == 8
    assert all(abs(t - i * 0.25) < 1e-9 for i, t in enumerate(times))


def test_a_burst_adds_its_rate_only_inside_its_window() -> None:
    spec = ArrivalSpec(rate=5.0, bursts=(Burst(start=10.0, duration=2.0, rate=95.0),))
    assert rate_at(spec, 9.99) == 5.0 and rate_at(spec, 10.0) == 100.0 and rate_at(spec, 12.0) == 5.0
    counts = {"inside": 0, "outside": 0}
    for seed in range(20):
        for t in open_loop_times(spec, random.Random(seed), horizon=20.0):
            counts["inside" if 10.0 <= t < 12.0 else "outside"] += 1
    # Means over 20 runs (inside 100/s x 2 s, outside 5/s x 18 s), within 5 standard errors.
    assert abs(counts["inside"] / 20 - 200) < 5 * math.sqrt(200 / 20)
    assert abs(counts["outside"] / 20 - 90) < 5 * math.sqrt(90 / 20)


def test_periodic_bursts_repeat_and_the_mean_rate_accounts_for_them() -> None:
    spec = ArrivalSpec(rate=0.0, bursts=(Burst(start=1.0, duration=0.5, rate=40.0, every=3.0),))
    assert mean_rate(spec, 30.0) == pytest.approx(40.0 * 0.5 * 10 / 30.0)
    times = list(open_loop_times(spec, random.Random(1), horizon=30.0))
    # With no base rate, every arrival falls inside a burst window.
    assert times and all((t - 1.0) % 3.0 < 0.5 for t in times)
    assert {int((t - 1.0) // 3.0) for t in times} == set(range(10))


def test_no_rate_and_no_bursts_means_no_arrivals() -> None:
    assert list(open_loop_times(ArrivalSpec(rate=0.0), random.Random(), horizon=10.0)) == []
