"""Workload specs: parsing, validation, the shipped named workloads, traces, seeded sampling."""

from __future__ import annotations

import json
import math
import pathlib
import random
import statistics
from collections import Counter

import pytest

from tests.bench.benchkit import workload
from tokenrelay_tools.bench.workload import (
    SessionSampler,
    WorkloadError,
    available_workloads,
    load_trace,
    load_workload,
    parse_dist,
)

SHIPPED = ("chat-multiturn", "long-context", "mixed-tenants", "burst")


def _take(sampler: SessionSampler, n: int) -> list:
    it = iter(sampler)
    return [next(it) for _ in range(n)]


def test_lognormal_lengths_have_the_requested_median_and_stay_clamped() -> None:
    d = parse_dist({"dist": "lognormal", "median": 200, "sigma": 0.8, "min": 20, "max": 900}, "x")
    rng = random.Random(7)
    xs = [d.sample_int(rng) for _ in range(4000)]
    assert min(xs) >= 20 and max(xs) <= 900
    assert min(xs) == 20 and max(xs) == 900  # sigma 0.8 reaches both clamps in 4000 draws
    assert abs(statistics.median(xs) - 200) / 200 < 0.08


@pytest.mark.parametrize("spec", [
    {"dist": "uniform", "min": 3, "max": 9},
    {"dist": "normal", "mean": 50, "sigma": 5, "min": 0},
    {"dist": "exponential", "mean": 2.0},
    {"dist": "choice", "values": [1, 5, 9], "weights": [1, 0, 1]},
])
def test_each_distribution_samples_within_its_support(spec: dict) -> None:
    d = parse_dist(spec, "x")
    rng = random.Random(1)
    xs = [d.sample(rng) for _ in range(2000)]
    if spec["dist"] == "uniform":
        assert 3 <= min(xs) and max(xs) <= 9 and abs(statistics.mean(xs) - 6) < 0.3
    elif spec["dist"] == "normal":
        assert abs(statistics.mean(xs) - 50) < 0.5
    elif spec["dist"] == "exponential":
        assert min(xs) >= 0 and abs(statistics.mean(xs) - 2.0) < 0.2
    else:
        assert set(xs) == {1.0, 9.0}  # weight 0 never drawn


def test_a_plain_number_is_a_constant() -> None:
    assert parse_dist(42, "x").sample_int(random.Random()) == 42


@pytest.mark.parametrize("spec, message", [
    ({"dist": "zipf"}, "unknown dist"),
    ({"dist": "uniform", "min": 1}, "finite `max`"),
    ({"dist": "lognormal", "median": 0}, "median > 0"),
    ({"dist": "constant", "value": 5, "min": 9, "max": 3}, "min > max"),
    ({"dist": "choice"}, "needs `values`"),
    ({"dist": "constant", "valeu": 3}, "valeu"),
    ("many", "expected a number"),
])
def test_bad_distributions_are_rejected_naming_the_field(spec: object, message: str) -> None:
    with pytest.raises(WorkloadError, match=message) as err:
        parse_dist(spec, "classes.chat.prompt_tokens")
    assert "classes.chat.prompt_tokens" in str(err.value)


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_workloads_load_by_name_and_sample(name: str) -> None:
    assert name in available_workloads()
    w = load_workload(name)
    assert w.name == name and w.description and w.duration > 0
    plans = _take(SessionSampler(w), 50)
    tenants = {t.name for t in w.tenants}
    assert {p.tenant for p in plans} <= tenants
    assert all(t.prompt_tokens >= 1 and t.output_tokens >= 1 for p in plans for t in p.turns)


def test_unknown_workload_name_lists_the_known_ones() -> None:
    with pytest.raises(WorkloadError, match="chat-multiturn"):
        load_workload("no-such-workload")


def test_sampling_is_deterministic_for_a_seed_and_differs_across_seeds() -> None:
    w = load_workload("mixed-tenants")
    a, b = _take(SessionSampler(w, seed=11), 30), _take(SessionSampler(w, seed=11), 30)
    c = _take(SessionSampler(w, seed=12), 30)
    assert a == b
    assert a != c


def test_tenant_weights_priorities_and_class_restrictions_are_respected() -> None:
    w = load_workload("mixed-tenants")
    plans = _take(SessionSampler(w, seed=5), 4000)
    share = Counter(p.tenant for p in plans)
    weights = {t.name: t.weight for t in w.tenants}
    for tenant, weight in weights.items():
        expected = weight / sum(weights.values())
        assert abs(share[tenant] / len(plans) - expected) < 0.03, tenant
    noisy = [p for p in plans if p.tenant == "noisy-batch"]
    assert {p.priority for p in noisy} == {"low"} and {p.cls for p in noisy} == {"batch"}
    team_b = [p for p in plans if p.tenant == "team-b"]
    assert {p.priority for p in team_b} == {"high", "normal"} and {p.cls for p in team_b} == {"interactive"}


def test_chat_sessions_have_turns_in_range_and_think_only_between_turns() -> None:
    w = workload(classes=[{"name": "c", "kind": "chat", "turns": {"dist": "uniform", "min": 2, "max": 5},
                           "think_time": {"dist": "exponential", "mean": 0.5}, "system_tokens": 30}])
    plans = _take(SessionSampler(w, seed=3), 300)
    assert {len(p.turns) for p in plans} == {2, 3, 4, 5}
    assert all(p.kind == "chat" and p.system_tokens == 30 for p in plans)
    assert all(p.turns[0].think_time == 0 for p in plans)
    assert statistics.mean(t.think_time for p in plans for t in p.turns[1:]) == pytest.approx(0.5, rel=0.15)


def test_length_scale_shrinks_every_sampled_length() -> None:
    w = load_workload("long-context")
    full = _take(SessionSampler(w, seed=9), 40)
    tenth = _take(SessionSampler(w, seed=9, length_scale=0.1), 40)
    for a, b in zip(full, tenth, strict=True):
        assert a.tenant == b.tenant and a.cls == b.cls
        for x, y in zip(a.turns, b.turns, strict=True):
            assert abs(y.prompt_tokens - x.prompt_tokens * 0.1) <= 1
            assert abs(y.output_tokens - x.output_tokens * 0.1) <= 1


def test_turns_imply_chat_and_the_kind_must_be_known() -> None:
    w = workload(classes=[{"name": "c", "turns": {"dist": "uniform", "min": 1, "max": 3}}])
    assert w.classes[0].kind == "chat"
    with pytest.raises(WorkloadError, match="kind"):
        workload(classes=[{"name": "c", "kind": "essay"}])


@pytest.mark.parametrize("spec, message", [
    ({"tenants": [{"name": "a", "classes": {"nope": 1}}]}, "unknown name 'nope'"),
    ({"tenants": [{"name": "a", "priorities": {"urgent": 1}}]}, "unknown name 'urgent'"),
    ({"tenants": [{"name": "a", "priorities": {"low": 0}}]}, "sum to zero"),
    ({"tenants": [{"name": "a", "colour": "red"}]}, "unknown keys"),
    ({"arrival": {"mode": "poisson", "rate": 0}}, "rate must be > 0"),
    ({"arrival": {"mode": "lunar"}}, "arrival.mode"),
    ({"classes": [{"name": "x"}, {"name": "x"}]}, "duplicate"),
])
def test_bad_workloads_are_rejected(spec: dict, message: str) -> None:
    with pytest.raises(WorkloadError, match=message):
        workload(**spec)


def _write_jsonl(path: pathlib.Path, rows: list[dict]) -> pathlib.Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_jsonl_trace_replays_sessions_in_order_at_relative_times(tmp_path: pathlib.Path) -> None:
    trace = _write_jsonl(tmp_path / "t.jsonl", [
        {"timestamp": 100.0, "tenant": "a", "prompt_tokens": 10, "output_tokens": 5, "session_id": "s"},
        {"timestamp": 100.5, "tenant": "b", "priority": "high", "input_tokens": 7, "GeneratedTokens": 3},
        {"timestamp": 102.0, "tenant": "a", "prompt_tokens": 4, "output_tokens": 6, "session_id": "s"},
    ])
    w = load_workload(str(trace))
    assert w.arrival.mode == "trace" and {t.name for t in w.tenants} == {"a", "b"}
    plans = list(SessionSampler(w))
    assert [p.start for p in plans] == [0.0, 0.5]
    chat, single = plans
    assert chat.kind == "chat" and [(t.prompt_tokens, t.output_tokens, t.at) for t in chat.turns] == \
        [(10, 5, 0.0), (4, 6, 2.0)]
    assert single.priority == "high" and single.turns[0].prompt_tokens == 7 and single.turns[0].output_tokens == 3
    assert w.duration > 2.0


def test_a_trace_without_lengths_is_rejected(tmp_path: pathlib.Path) -> None:
    with pytest.raises(WorkloadError, match="line 1"):
        load_trace(_write_jsonl(tmp_path / "bad.jsonl", [{"timestamp": 1, "prompt_tokens": 3}]))


def test_lengths_can_be_sampled_from_a_trace_file(tmp_path: pathlib.Path) -> None:
    _write_jsonl(tmp_path / "lens.jsonl", [{"prompt_tokens": n} for n in (11, 22, 33)])
    spec = tmp_path / "w.yaml"
    spec.write_text("classes:\n  - name: c\n"
                    "    prompt_tokens: {dist: choice, file: lens.jsonl, field: prompt_tokens}\n")
    w = load_workload(str(spec))
    seen = {p.turns[0].prompt_tokens for p in _take(SessionSampler(w, seed=1), 200)}
    assert seen == {11, 22, 33}
    assert not math.isinf(w.classes[0].prompt_tokens.upper)
