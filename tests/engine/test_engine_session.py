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


async def test_a_stream_whose_requests_wait_behind_the_batch_sends_keepalives() -> None:
    # A request queued in the engine (the KV cache full) sends nothing until it runs; without a
    # message its router took the silent stream for a stalled engine after its progress timeout.
    engine = Engine(SimBackend(fast_sim(decode_step_time=0.05, num_blocks=4, tokens_per_block=4)), max_queued=10)
    await engine.start()
    try:
        hold = asyncio.Event()

        async def inbound(*requests: object) -> AsyncIterator[Inbound]:
            yield Inbound(submit=list(requests))  # type: ignore[arg-type]
            await hold.wait()

        busy = StreamSession(engine)
        running = busy.run(inbound(req("runs", [1], 12)))
        assert await anext(running)                     # "runs" holds the whole KV cache
        waiting = StreamSession(engine, keepalive=0.05)
        idle = StreamSession(engine, keepalive=0.05)
        loop = asyncio.get_running_loop()
        seen: list[tuple[float, list[object]]] = []

        async def read_waiting() -> None:
            async for chunks in waiting.run(inbound(req("waits", [2], 4))):
                seen.append((loop.time(), chunks))
                if any(c.token_ids for c in chunks):
                    return
        idle_seen: list[object] = []

        async def read_idle() -> None:
            async for chunks in idle.run(inbound()):
                idle_seen.append(chunks)
        idle_task = asyncio.ensure_future(read_idle())
        reader = asyncio.ensure_future(read_waiting())
        await asyncio.sleep(0.3)
        assert not reader.done() and engine.load().queued == 1, "the second request did not wait"
        empties = [t for t, chunks in seen if not chunks]
        assert len(empties) >= 3, f"{len(empties)} keepalives in 0.3 s at a 0.05 s interval"
        assert idle_seen == [], "a stream with no requests sends nothing"
        async for chunks in running:                     # let "runs" finish: "waits" runs then
            if any(c.finished for c in chunks):
                break
        await asyncio.wait_for(reader, 5)
        idle_task.cancel()
        busy.close(), waiting.close(), idle.close()
    finally:
        hold.set()
        await engine.close()
