"""The engine stage's attempt rules, with fake ports (no network).

Before the first token a retryable failure (stream broken, in-band OVERLOADED, SHUTTING_DOWN,
ENGINE_UNAVAILABLE, silence past the progress timeout) is retried on another replica and never
reaches the client; after it, or when the attempts are spent, or for a non-retryable reason, the
request fails.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from router_svc.types import Delta, Done, GenerateInput, Migrated, Sampling
from services.errors import Reason, TokenrelayError
from tests.router.core_fakes import TENANT, FakeReplica, core, uid
from tests.waiting import poll


def _inp(**kw: Any) -> GenerateInput:
    return GenerateInput(Sampling(max_tokens=8), prompt="hi", **kw)


async def _run(router: Any, inp: GenerateInput, deadline: float | None = None) -> list[Any]:
    return [e async for e in router.generate(TENANT, inp, deadline)]


def _before_submit(c: Any, hook: Any) -> None:
    """`hook(request_id)` runs at each submit to an engine, before the submit itself."""
    submit = c.engines.submit

    def hooked(address: str, request_id: str, *a: Any, **k: Any) -> Any:
        hook(request_id)
        return submit(address, request_id, *a, **k)
    c.engines.submit = hooked


@pytest.mark.parametrize("failure", ["broken", Reason.OVERLOADED, Reason.SHUTTING_DOWN, Reason.ENGINE_UNAVAILABLE])
async def test_a_retryable_failure_before_the_first_token_is_retried_elsewhere(failure: object) -> None:
    c = core(FakeReplica("bad", [failure]), FakeReplica("good", ["ok"], in_flight=5))
    events = await _run(c.router, _inp(request_id="r"))
    assert isinstance(events[-1], Done) and events[-1].usage.completion_tokens == 3
    bad, good = c.engines.replicas["bad"].submitted, c.engines.replicas["good"].submitted
    assert len(bad) == 1 and good == bad     # the same request, tried on the other
    # a busy replica stays in the pool; a broken or draining one takes no new work
    assert (c.engines.failed == ["bad"]) == (failure != Reason.OVERLOADED)


async def test_a_non_retryable_engine_error_fails_at_once() -> None:
    c = core(FakeReplica("a", [Reason.INVALID_SAMPLING]), FakeReplica("b", in_flight=5))
    with pytest.raises(TokenrelayError) as info:
        await _run(c.router, _inp())
    assert info.value.reason == Reason.INVALID_SAMPLING
    assert c.engines.replicas["b"].submitted == []


async def test_attempts_are_bounded_and_the_client_hears_the_last_reason() -> None:
    c = core(FakeReplica("a", ["broken"]), FakeReplica("b", ["broken"], in_flight=1),
             FakeReplica("c", ["ok"], in_flight=2), engine_attempts=2)
    with pytest.raises(TokenrelayError) as info:
        await _run(c.router, _inp())
    assert info.value.reason == Reason.UPSTREAM_UNAVAILABLE
    assert c.engines.replicas["c"].submitted == []


async def test_with_no_replica_left_the_client_hears_why_the_last_failed_not_no_replica() -> None:
    c = core(FakeReplica("a", [Reason.OVERLOADED]), engine_attempts=3)
    with pytest.raises(TokenrelayError) as info:
        await _run(c.router, _inp())
    assert info.value.reason == Reason.OVERLOADED


async def test_without_migrations_a_failure_after_the_first_token_is_not_retried() -> None:
    c = core(FakeReplica("a", ["manual"]), FakeReplica("b", in_flight=5), engine_migrations=0)
    gen = c.router.generate(TENANT, _inp(request_id="r"))
    await anext(gen)                                     # accepted
    delta = asyncio.ensure_future(anext(gen))
    source = await poll(lambda: c.engines.replicas["a"].sources.get(uid(c, "r")))
    source.tokens(101)
    assert isinstance(await delta, Delta)
    source.broken()
    with pytest.raises(TokenrelayError) as info:
        await anext(gen)
    assert info.value.reason == Reason.UPSTREAM_UNAVAILABLE
    assert c.engines.replicas["b"].submitted == []


async def test_silence_before_the_first_token_is_retried_on_another_replica() -> None:
    c = core(FakeReplica("mute", ["hang"]), FakeReplica("b", ["ok"], in_flight=5), progress_timeout=0.2)
    events = await _run(c.router, _inp(request_id="r"))
    assert isinstance(events[-1], Done)
    mute = c.engines.replicas["mute"]
    assert len(mute.aborted) == 1 and mute.aborted == mute.submitted


async def test_a_stall_after_the_first_token_with_no_replica_left_fails_with_engine_stalled() -> None:
    c = core(FakeReplica("a", ["manual"]), progress_timeout=0.2)
    gen = c.router.generate(TENANT, _inp(request_id="r"))
    await anext(gen)
    delta = asyncio.ensure_future(anext(gen))
    source = await poll(lambda: c.engines.replicas["a"].sources.get(uid(c, "r")))
    source.tokens(101)
    assert isinstance(await delta, Delta)
    with pytest.raises(TokenrelayError) as info:
        await anext(gen)
    assert info.value.reason == Reason.ENGINE_STALLED and info.value.retryable
    assert c.engines.replicas["a"].aborted == c.engines.replicas["a"].submitted


@pytest.mark.parametrize("failure", ["broken", "stalled", Reason.ENGINE_UNAVAILABLE])
async def test_a_replica_failing_mid_stream_is_migrated_and_the_stream_goes_on(failure: object) -> None:
    c = core(FakeReplica("a", ["manual"]), FakeReplica("b", ["manual"], in_flight=5), progress_timeout=0.3)
    gen = c.router.generate(TENANT, _inp(request_id="r"))
    await anext(gen)                                     # accepted
    delta = asyncio.ensure_future(anext(gen))
    a = await poll(lambda: c.engines.replicas["a"].sources.get(uid(c, "r")))
    a.tokens(101, 102)
    first = await delta
    assert isinstance(first, Delta)
    if failure == "broken":
        a.broken()
    elif isinstance(failure, Reason):
        a.error(failure)
    nxt = asyncio.ensure_future(anext(gen))              # "stalled": a sends nothing more
    b = await poll(lambda: c.engines.replicas["b"].sources.get(uid(c, "r")))
    prompt_a, max_a = c.engines.replicas["a"].prompts[0]
    assert c.engines.replicas["b"].prompts == [([*prompt_a, 101, 102], max_a - 2)]   # prompt + tokens so far
    b.tokens(103, finished=True)
    moved = await nxt
    assert isinstance(moved, Migrated) and moved.migrations == 1 and moved.tokens_so_far == 2
    rest = [e async for e in gen]
    assert isinstance(rest[-1], Done) and rest[-1].usage.completion_tokens == 3
    assert "".join(e.text for e in [first, *rest] if isinstance(e, Delta)) == "".join(
        f"<{t}>" for t in (101, 102, 103))
    assert "a" in c.engines.failed


async def test_a_draining_replica_gets_no_new_work() -> None:
    c = core(FakeReplica("drain", serving=False), FakeReplica("b", in_flight=9))
    await _run(c.router, _inp(request_id="r"))
    assert c.engines.replicas["drain"].submitted == []


async def test_a_session_sticks_to_its_replica() -> None:
    c = core(FakeReplica("a"), FakeReplica("b"))
    await _run(c.router, _inp(request_id="1", session_id="s"))
    first = next(r for r in c.engines.replicas.values() if r.submitted)
    first.in_flight += 10    # now the more loaded one: the session still goes there
    await _run(c.router, _inp(request_id="2", session_id="s"))
    assert len(first.submitted) == 2


async def test_the_deadline_and_priority_are_pushed_down_to_the_engine() -> None:
    c = core(FakeReplica("a", ["ok"]))
    await _run(c.router, _inp(priority=3), deadline=time.monotonic() + 20.0)
    [(timeout, priority)] = c.engines.replicas["a"].pushed_down
    assert 0 < timeout <= 20.0 and priority == 3


async def test_plain_chunks_the_first_included_skip_the_stage_task_and_keep_their_order() -> None:
    """The engine stage's sink (services/mux.py `Inbox.sink`): plain new tokens, the first included
    (its prefix-cache hits kept), go from the stream's reader to the detokenizer at once; the last chunk
    goes through the stage task. The client sees every token, in order."""
    c = core(FakeReplica("a", ["inbox"]))
    gen = c.router.generate(TENANT, _inp(request_id="r"))
    await anext(gen)                                     # accepted
    source = await poll(lambda: c.engines.replicas["a"].sources.get(uid(c, "r")))
    await poll(lambda: source.sink is not None, what="the stage's sink installed")
    source.tokens(1, cached=7)                           # the first: by the sink too (prefill ends)
    first = await anext(gen)
    assert isinstance(first, Delta) and first.text == "<1>" and source.sunk == 1
    source.tokens(2)
    source.tokens(3, 4)
    source.tokens(5, finished=True)                      # the last: through the task
    rest = [e async for e in gen]
    assert "".join(e.text for e in rest if isinstance(e, Delta)) == "<2><3><4><5>"
    assert isinstance(rest[-1], Done) and rest[-1].usage.completion_tokens == 5
    assert rest[-1].usage.cached_tokens == 7
    assert source.sunk == 3 and source.sink is None      # three plain chunks took the sink; removed at the end


async def test_the_submit_goes_out_before_the_detokenizer_session_starts_with_no_loop_turn_between() -> None:
    """A granted request is placed and submitted in the step that has its grant (`EngineStage.start`),
    before its detokenizer session starts (measured: the session's start held the submit back by ~0.1 ms
    on quiet cores, and the stage's own task one loop turn more)."""
    c = core(FakeReplica("a", ["ok"]))
    seen: list[tuple[str, bool]] = []

    def watched(request_id: str) -> None:
        session = c.detok.sessions.get(request_id)
        seen.append((request_id, session is not None and session.started))
    _before_submit(c, watched)
    loop = asyncio.get_running_loop()
    turns_at_submit: list[int] = []
    admit = c.admission.admit
    turns = 0

    def tick() -> None:
        nonlocal turns
        turns += 1
        loop.call_soon(tick) if not seen else turns_at_submit.append(turns)

    async def granted(request: Any) -> Any:
        grant = await admit(request)
        loop.call_soon(tick)     # counts the loop's turns from the grant on
        return grant
    c.admission.admit = granted  # type: ignore[method-assign]
    events = await _run(c.router, _inp(request_id="r"))
    assert isinstance(events[-1], Done) and events[-1].usage.completion_tokens == 3
    assert len(seen) == 1 and seen[0][1] is False       # the session was not started yet
    assert turns_at_submit == [1]       # submitted before the loop's next turn after the grant's
    assert c.detok.sessions[seen[0][0]].started


async def test_the_engine_streams_sender_writes_the_submit_before_the_detokenizer_session_starts() -> None:
    """The engine stream's sender is a task that the submit wakes (services/mux.py): it writes on the
    loop's next turn. The loop turns once after a submit made in the granting step, before the
    detokenizer session's start and the rest of that step (measured: they held the write back by
    ~0.2 ms on a 2-core machine). Here the fake's submit wakes a sender the same way."""
    c = core(FakeReplica("a", ["ok"]))
    written: list[tuple[str, bool]] = []     # per write: had the request's detokenizer session started?
    loop = asyncio.get_running_loop()

    def woken(request_id: str) -> None:
        def write() -> None:
            session = c.detok.sessions.get(request_id)
            written.append((request_id, session is not None and session.started))
        loop.call_soon(write)
    _before_submit(c, woken)
    events = await _run(c.router, _inp(request_id="r"))
    assert isinstance(events[-1], Done) and events[-1].usage.completion_tokens == 3
    assert [w[1] for w in written] == [False]
    assert c.detok.sessions[written[0][0]].started


async def test_a_client_gone_in_the_loop_turn_after_the_submit_leaves_nothing_behind() -> None:
    """The request's generator is suspended in that one loop turn after its submit: a client that goes
    away then (its call cancelled) has its engine work aborted and released, its lease and id given
    back, its never-started detokenizer session closed, and no stage task left running."""
    c = core(FakeReplica("a", ["inbox"]))
    consumer: asyncio.Task[Any] | None = None

    def cancelling(_request_id: str) -> None:
        assert consumer is not None
        asyncio.get_running_loop().call_soon(consumer.cancel)   # lands while the generator waits that turn
    _before_submit(c, cancelling)
    before = asyncio.all_tasks()
    gen = c.router.generate(TENANT, _inp(request_id="r"))
    consumer = asyncio.ensure_future(anext(gen))
    with pytest.raises(asyncio.CancelledError):
        await consumer
    await gen.aclose()
    a = c.engines.replicas["a"]
    assert len(a.submitted) == 1 and a.aborted == a.submitted and a.released == a.submitted
    session = c.detok.sessions[a.submitted[0]]
    assert not session.started and session.closed is False      # closed, with nothing to flush
    assert c.admission.held == set() and c.router.in_flight == 0
    await asyncio.sleep(0)
    assert asyncio.all_tasks() - before == set()


async def test_a_session_whose_replica_lookup_is_not_answered_is_placed_once_it_is() -> None:
    """A session's replica decides its placement: when its lookup has not answered by the grant, the
    stage's task waits for it and places then (the session still sticks)."""
    c = core(FakeReplica("a"), FakeReplica("b"))
    await _run(c.router, _inp(request_id="1", session_id="s"))
    first = next(r for r in c.engines.replicas.values() if r.submitted)
    first.in_flight += 10
    gate = asyncio.Event()
    get = c.router.stage.affinity.get

    async def slow(tenant: str, session: str) -> str:
        await gate.wait()
        return await get(tenant, session)
    c.router.stage.affinity.get = slow  # type: ignore[method-assign]
    c.router.ports.affinity.get = slow  # type: ignore[method-assign]
    gen = c.router.generate(TENANT, _inp(request_id="2", session_id="s"))
    waiting = asyncio.ensure_future(anext(gen))
    await poll(lambda: c.router.live("t", "2") is not None and c.router.live("t", "2").t_admitted > 0,
               what="granted")
    for _ in range(5):
        await asyncio.sleep(0)
    assert sum(len(r.submitted) for r in c.engines.replicas.values()) == 1    # not placed yet
    gate.set()
    rest = [await waiting, *[e async for e in gen]]
    assert isinstance(rest[-1], Done) and len(first.submitted) == 2


async def test_a_placement_that_fails_in_the_granting_step_fails_the_request_cleanly() -> None:
    """No replica to place on when granted: the request fails with its typed reason, its lease and id
    given back, its detokenizer session closed; nothing was submitted."""
    c = core(FakeReplica("down", healthy=False))
    with pytest.raises(TokenrelayError) as info:
        await _run(c.router, _inp(request_id="r"))
    assert info.value.reason == Reason.NO_HEALTHY_REPLICA
    assert c.engines.replicas["down"].submitted == []
    assert c.admission.held == set() and c.router.in_flight == 0
    [session] = c.detok.sessions.values()
    assert session.closed is False


async def test_a_detokenizer_session_that_fails_to_start_after_the_submit_aborts_the_engine_work() -> None:
    """The submit now comes before the detokenizer session's start: a start that raises (a defect in a
    port) still aborts and releases the request at its engine and leaves no stage task behind."""
    c = core(FakeReplica("a", ["inbox"]))

    class Broken(Exception):
        pass

    def broken_start(*a: Any, **k: Any) -> None:
        raise Broken()
    made = c.detok.detokenizer

    def detokenizer(request_id: str) -> Any:
        session = made(request_id)
        session.start = broken_start  # type: ignore[method-assign]
        return session
    c.detok.detokenizer = detokenizer  # type: ignore[method-assign]
    before = asyncio.all_tasks()
    with pytest.raises(Broken):
        await _run(c.router, _inp(request_id="r"))
    a = c.engines.replicas["a"]
    assert len(a.submitted) == 1 and a.aborted == a.submitted and a.released == a.submitted
    assert c.admission.held == set() and c.router.in_flight == 0
    await asyncio.sleep(0)
    assert asyncio.all_tasks() - before == set()
