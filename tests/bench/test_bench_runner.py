"""The runner against an in-process fake target: bounds, loops, timeouts, errors, context fitting."""

from __future__ import annotations

import asyncio

from services.errors import ResourceExhausted
from tests.bench.benchkit import FakeBehaviour, FakeTarget, poll, workload
from tokenrelay_tools.bench.runner import RunConfig, Runner, records_by_session

CHAT = {"name": "chat", "kind": "chat", "turns": 3, "prompt_tokens": 20, "output_tokens": 8}
SINGLE = {"name": "single", "prompt_tokens": 50, "output_tokens": 6}


def _closed(concurrency: int, classes: list[dict] | None = None, **kw: object):
    return workload(arrival={"mode": "closed", "concurrency": concurrency}, classes=classes or [SINGLE], **kw)


async def test_closed_loop_issues_exactly_the_request_budget_within_the_concurrency() -> None:
    target = FakeTarget()
    result = await Runner(target, _closed(3, [CHAT, SINGLE]), RunConfig(duration=None, requests=25)).run()
    assert len(result.records) == 25 and all(r.ok for r in result.records)
    assert result.stopped_by == "requests"
    assert 1 <= target.peak_in_flight <= 3
    assert sorted(r.index for r in result.records) == list(range(25))
    # Chats send their turns in order, and each turn's tokens were all observed.
    for r in result.records:
        assert r.completion_tokens == r.planned_output_tokens
        assert sum(n for _, n in r.deltas) == r.completion_tokens
    by_session: dict[int, list[int]] = {}
    for r in result.records:
        by_session.setdefault(r.session, []).append(r.turn)
    assert all(turns == list(range(len(turns))) for turns in by_session.values())


async def test_open_loop_stops_at_the_duration_and_counts_sessions() -> None:
    w = workload(arrival={"mode": "constant", "rate": 50}, classes=[SINGLE])
    result = await Runner(FakeTarget(), w, RunConfig(duration=0.3)).run()
    assert result.stopped_by == "duration"
    # Evenly spaced from t=0 at 50/s for 0.3 s: 15 arrivals (the last one may race the timer).
    assert 14 <= len(result.records) <= 15 and result.sessions == len(result.records)
    starts = [r.start for r in result.records]
    assert max(starts) < 0.3 + 0.05


async def test_a_request_over_its_timeout_is_recorded_and_the_run_goes_on() -> None:
    behaviour = FakeBehaviour(hang=lambda plan, i: plan.index == 1)
    w = _closed(2)
    result = await Runner(FakeTarget(behaviour), w, RunConfig(duration=None, requests=6, request_timeout=0.2)).run()
    failed = [r for r in result.records if not r.ok]
    assert [(r.status, r.reason, r.session) for r in failed] == [("DEADLINE_EXCEEDED", "BENCH_TIMEOUT", 1)]
    assert len(result.records) == 6


async def test_requests_still_running_after_the_drain_timeout_are_cancelled() -> None:
    target = FakeTarget(FakeBehaviour(hang=lambda plan, i: True))
    runner = Runner(target, _closed(2), RunConfig(duration=None, requests=2, drain_timeout=0.1))
    result = await runner.run()
    assert [(r.status, r.reason) for r in result.records] == [("CANCELLED", "BENCH_DRAIN_TIMEOUT")] * 2
    assert target.in_flight == 0


async def test_typed_errors_are_counted_by_status_and_reason_and_end_the_chat() -> None:
    def fail(plan, i):
        return ResourceExhausted("queue full", "TENANT_QUEUE_FULL") if i == 1 else None

    target = FakeTarget(FakeBehaviour(fail=fail))
    result = await Runner(target, _closed(1, [CHAT]), RunConfig(duration=None, requests=6)).run()
    errors = [(r.status, r.reason, r.turn) for r in result.records if not r.ok]
    assert errors and all(e == ("RESOURCE_EXHAUSTED", "TENANT_QUEUE_FULL", 1) for e in errors)
    assert all(turn < 2 for _, turn, _ in target.turns_seen)  # no third turn after a failed second


async def test_turns_that_outgrow_the_context_end_the_chat_and_first_turns_are_clipped() -> None:
    chat = {**CHAT, "turns": 10, "prompt_tokens": 30, "output_tokens": 10}
    target = FakeTarget(FakeBehaviour(max_context=100))
    result = await Runner(target, _closed(1, [chat]), RunConfig(duration=None, requests=4)).run()
    # Context grows 40 per turn: turns 1 and 2 fit (40, 80), the third would need 120.
    assert result.truncated_sessions >= 1
    assert len(result.records) == 4  # a truncated turn spends none of the request budget
    assert all(r.prompt_tokens + r.completion_tokens <= 100 for r in result.records)
    assert {r.turn for r in result.records} == {0, 1}

    big = {**SINGLE, "prompt_tokens": 500}
    clipped = await Runner(FakeTarget(FakeBehaviour(max_context=100)), _closed(1, [big]),
                           RunConfig(duration=None, requests=2)).run()
    assert clipped.clipped_requests == 2
    assert all(r.prompt_tokens + r.completion_tokens <= 100 for r in clipped.records)


async def test_open_loop_drops_arrivals_over_the_session_cap() -> None:
    hold = asyncio.Event()
    target = FakeTarget(FakeBehaviour(hold=hold))
    w = workload(arrival={"mode": "constant", "rate": 200}, classes=[SINGLE])
    runner = Runner(target, w, RunConfig(duration=0.2, max_sessions=3))
    task = asyncio.create_task(runner.run())
    await poll(lambda: runner.elapsed > 0.2, what="the run's duration to pass")
    hold.set()
    result = await task
    assert len(result.records) == 3
    assert result.dropped_sessions >= 30


async def test_runs_with_the_same_seed_send_the_same_plan() -> None:
    w = _closed(1, [CHAT, SINGLE])
    a, b = FakeTarget(), FakeTarget()
    await Runner(a, w, RunConfig(duration=None, requests=12, seed=4)).run()
    await Runner(b, w, RunConfig(duration=None, requests=12, seed=4)).run()
    assert a.turns_seen == b.turns_seen


async def test_a_replay_sends_exactly_the_requests_of_the_earlier_run() -> None:
    chat = {**CHAT, "turns": {"dist": "uniform", "min": 1, "max": 4},
            "think_time": {"dist": "exponential", "mean": 0.01}}
    w = workload(arrival={"mode": "poisson", "rate": 100}, classes=[chat, SINGLE])
    first = await Runner(FakeTarget(), w, RunConfig(duration=0.15, seed=2)).run()
    assert first.records
    # Pretend the first target's prompts grew by 3 tokens per turn beyond the plan (a chat template).
    for r in first.records:
        r.prompt_tokens += 3 * (r.turn + 1)
    replayer = FakeTarget()
    second = await Runner(replayer, w, RunConfig(duration=None, seed=2, replay=records_by_session(first.records))).run()
    assert second.stopped_by == "replay complete"
    sent = {(r.session, r.turn): (r.prompt_tokens, r.completion_tokens) for r in first.records}
    assert {(r.session, r.turn): (r.prompt_tokens, r.completion_tokens) for r in second.records} == sent
    # Sessions keep their arrival slots: the replayed run starts them at (nearly) the same offsets.
    starts = {r.session: r.start for r in first.records if r.turn == 0}
    assert all(abs(r.start - starts[r.session]) < 0.1 for r in second.records if r.turn == 0)


async def test_failed_requests_record_when_they_failed_and_the_wall_covers_the_drain() -> None:
    # A refusal fails at once; a request cut off by the drain fails drain_timeout later: the run's
    # wall time (and so the throughput chart) must reach that failure, not stop at the last success.
    def fail(plan, i):
        return ResourceExhausted("busy", "TENANT_CONCURRENCY_LIMIT") if plan.index == 1 else None

    target = FakeTarget(FakeBehaviour(hang=lambda plan, i: plan.index == 2, fail=fail))
    result = await Runner(target, _closed(3), RunConfig(duration=None, requests=3, drain_timeout=0.2)).run()
    by_session = {r.session: r for r in result.records}
    assert by_session[1].reason == "TENANT_CONCURRENCY_LIMIT" and by_session[2].reason == "BENCH_DRAIN_TIMEOUT"
    assert all(r.end is not None and r.end >= r.start for r in result.records)
    assert result.stopped_by == "requests" and result.stopped_at is not None
    assert by_session[2].end >= result.stopped_at + 0.2 - 0.02
    assert result.wall == max(r.end for r in result.records) and result.wall >= 0.18
    assert result.wall > by_session[0].end
