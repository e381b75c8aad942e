"""Unit tests of the stream plumbing without a network: the outbox and a session over the sim."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from engine_svc.backends.base import FinishReason, GenerationEvent
from engine_svc.backends.sim import SimBackend
from engine_svc.engine import Engine
from engine_svc.outbox import Outbox
from engine_svc.session import Inbound, StreamSession
from tests.engine.engine_testkit import fast_sim, poll, req


def test_outbox_coalesces_per_request_until_drained() -> None:
    box = Outbox()
    box.push(GenerationEvent("a", [1], cached_tokens=8))
    box.push(GenerationEvent("b", [7]))
    box.push(GenerationEvent("a", [2, 3]))
    box.push(GenerationEvent("b", [8], True, FinishReason.STOP))
    box.push_separate(GenerationEvent.failed("a", "DUPLICATE_REQUEST_ID", "dup"))
    chunks = box.drain()
    assert [(c.request_id, c.token_ids, c.finished) for c in chunks] == [
        ("a", [1, 2, 3], False), ("b", [7, 8], True), ("a", [], True)]
    assert chunks[0].cached_tokens == 8 and chunks[1].finish_reason is FinishReason.STOP
    assert chunks[2].error_reason == "DUPLICATE_REQUEST_ID"
    assert box.empty and box.drain() == [] and box.messages == 1
    box.push(GenerationEvent("a", [4]))
    assert [c.token_ids for c in box.drain()] == [[4]] and box.drain() == []
    assert box.messages == 2


async def test_session_serves_until_half_close_and_all_finished() -> None:
    engine = Engine(SimBackend(fast_sim()), max_queued=10)
    await engine.start()
    try:
        async def inbound() -> AsyncIterator[Inbound]:
            yield Inbound(submit=[req("x", [1, 2], 5), req("y", [3], 3)])
            yield Inbound(submit=[req("", [], 3)])

        session = StreamSession(engine)
        tokens: dict[str, list[int]] = {}
        finals = {}
        async for chunks in session.run(inbound()):
            for c in chunks:
                tokens.setdefault(c.request_id, []).extend(c.token_ids)
                if c.finished:
                    finals[c.request_id] = c
        assert len(tokens["x"]) == 5 and len(tokens["y"]) == 3
        assert finals[""].error_reason == "EMPTY_PROMPT"
        assert engine.live == 0
    finally:
        await engine.close()


async def test_closing_a_session_aborts_what_it_carries() -> None:
    engine = Engine(SimBackend(fast_sim(decode_step_time=0.001)), max_queued=10)
    await engine.start()
    try:
        never_ends = asyncio.Event()

        async def inbound() -> AsyncIterator[Inbound]:
            yield Inbound(submit=[req("long", [1], 400), req("long2", [2], 400)])
            await never_ends.wait()

        session = StreamSession(engine)
        stream = session.run(inbound())
        first = await anext(stream)
        assert first and session.live == 2 and engine.live == 2
        session.close()
        await poll(lambda: engine.live == 0 and engine.load().active == 0, what="aborted")
        await stream.aclose()
    finally:
        await engine.close()
