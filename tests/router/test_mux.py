"""services/mux.py: per-request inboxes (one wake-up per burst, everything ready in one take) and
the multiplexed client over a real gRPC stream on loopback."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from services.channels import bind_port, open_channel
from services.errors import Reason
from services.mux import Inbox, MuxClient, StreamBroken
from services.proto.tokenrelay.v1 import engine_pb2, engine_pb2_grpc
from services.security import PLAINTEXT


async def test_a_burst_costs_one_wake_up_and_one_take() -> None:
    inbox: Inbox[int] = Inbox()
    wakes = 0
    taken: list[list[int | StreamBroken]] = []

    async def consumer() -> None:
        nonlocal wakes
        while True:
            items = await inbox.get_ready()
            wakes += 1
            taken.append(items)
            if 99 in items:
                return

    task = asyncio.create_task(consumer())
    await asyncio.sleep(0)           # the consumer parks on its waiter
    for i in range(50):
        inbox.put_nowait(i)          # one burst: one future set, no call_soon per item
    await asyncio.sleep(0)
    for i in range(50, 100):
        inbox.put_nowait(i)
    await task
    assert wakes == 2
    assert taken == [list(range(50)), list(range(50, 100))]


async def test_get_returns_items_in_order_and_get_ready_never_waits_when_ready() -> None:
    inbox: Inbox[str] = Inbox()
    inbox.put_nowait("a")
    inbox.put_nowait("b")
    assert await inbox.get() == "a"
    assert await asyncio.wait_for(inbox.get_ready(), 0.5) == ["b"]
    assert inbox.empty() and inbox.qsize() == 0
    getter = asyncio.create_task(inbox.get())
    await asyncio.sleep(0)
    inbox.put_nowait("c")
    assert await getter == "c"


async def test_a_cancelled_consumer_leaves_no_stale_waiter() -> None:
    inbox: Inbox[int] = Inbox()
    task = asyncio.create_task(inbox.get_ready())
    await asyncio.sleep(0)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    inbox.put_nowait(1)              # must not touch the cancelled future
    assert await inbox.get_ready() == [1]


class _EchoEngine(engine_pb2_grpc.EngineServicer):
    """Answers every submit with `tokens` one-token chunks, all in one message, then breaks the
    stream when asked to (a submit with request id 'break')."""

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens
        self.messages_in = 0

    async def Stream(self, request_iterator: AsyncIterator[engine_pb2.EngineInbound],
                     context: grpc.aio.ServicerContext) -> AsyncIterator[engine_pb2.EngineOutbound]:
        async for message in request_iterator:
            self.messages_in += 1
            for r in message.submit:
                if r.request_id == "break":
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "going away")
                chunks = [engine_pb2.TokenChunk(request_id=r.request_id, token_ids=[i], finished=i == self.tokens - 1)
                          for i in range(self.tokens)]
                yield engine_pb2.EngineOutbound(chunks=chunks)


async def _serve(servicer: Any) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    engine_pb2_grpc.add_EngineServicer_to_server(servicer, server)
    port = bind_port(server, "127.0.0.1:0", PLAINTEXT)
    await server.start()
    return server, f"127.0.0.1:{port}"


def _client(address: str) -> tuple[grpc.aio.Channel, MuxClient[Any], list[Any]]:
    channel = open_channel(address, PLAINTEXT)
    stub = engine_pb2_grpc.EngineStub(channel)
    seen: list[Any] = []
    mux: MuxClient[Any] = MuxClient(
        "engine-test", stub.Stream, lambda p: engine_pb2.EngineInbound(submit=p.get("submit", [])),
        lambda resp: [(c.request_id, c) for c in resp.chunks], on_message=seen.append)
    return channel, mux, seen


async def test_the_chunks_of_one_message_arrive_in_one_take() -> None:
    server, address = await _serve(_EchoEngine(tokens=20))
    channel, mux, seen = _client(address)
    try:
        inbox = mux.open("r1")
        mux.post("submit", engine_pb2.EngineRequest(request_id="r1"))
        items = await asyncio.wait_for(inbox.get_ready(), 5)
        assert [c.token_ids[0] for c in items] == list(range(20))
        assert len(seen) == 1 and mux.messages_received == 1 and mux.items_received == 20
        mux.release("r1")
        assert mux.open_requests == 0
    finally:
        await mux.close()
        await channel.close()
        await server.stop(None)


async def test_a_broken_stream_fails_every_open_request_and_the_next_open_reconnects() -> None:
    server, address = await _serve(_EchoEngine(tokens=1))
    channel, mux, _ = _client(address)
    try:
        a, b = mux.open("a"), mux.open("b")
        mux.post("submit", engine_pb2.EngineRequest(request_id="break"))
        for inbox in (a, b):
            item = (await asyncio.wait_for(inbox.get_ready(), 5))[-1]
            assert isinstance(item, StreamBroken)
            assert item.error.reason == Reason.UPSTREAM_UNAVAILABLE and item.error.retryable
        assert mux.open_requests == 0
        c = mux.open("c")
        mux.post("submit", engine_pb2.EngineRequest(request_id="c"))
        chunk = await asyncio.wait_for(c.get(), 5)
        assert not isinstance(chunk, StreamBroken) and chunk.finished
    finally:
        await mux.close()
        await channel.close()
        await server.stop(None)


class _DripEngine(engine_pb2_grpc.EngineServicer):
    """Answers a submit with `tokens` messages of one single-token chunk each (a fast engine)."""

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens

    async def Stream(self, request_iterator: AsyncIterator[engine_pb2.EngineInbound],
                     context: grpc.aio.ServicerContext) -> AsyncIterator[engine_pb2.EngineOutbound]:
        async for message in request_iterator:
            for r in message.submit:
                for i in range(self.tokens):
                    yield engine_pb2.EngineOutbound(chunks=[engine_pb2.TokenChunk(
                        request_id=r.request_id, token_ids=[i], finished=i == self.tokens - 1)])


def _merge(pending: Any, raw: Any) -> bool:
    if pending["finished"] or raw.finished:
        return False
    pending["tokens"].extend(raw.token_ids)
    return True


def _merging_client(address: str, wake_delay: float = 0.0) -> tuple[grpc.aio.Channel, MuxClient[Any]]:
    """A client whose items are {"tokens", "finished"} dicts, plain tokens merged (`_merge`)."""
    channel = open_channel(address, PLAINTEXT)
    stub = engine_pb2_grpc.EngineStub(channel)
    mux: MuxClient[Any] = MuxClient(
        "engine-test", stub.Stream, lambda p: engine_pb2.EngineInbound(submit=p.get("submit", [])),
        lambda resp: [(c.request_id, c) for c in resp.chunks],
        convert=lambda c: {"tokens": list(c.token_ids), "finished": c.finished}, merge=_merge,
        max_wake_delay=wake_delay)
    return channel, mux


async def test_chunks_that_arrive_while_one_waits_are_merged_into_it() -> None:
    server, address = await _serve(_DripEngine(tokens=51))
    channel, mux = _merging_client(address)
    try:
        inbox = mux.open("r")
        mux.post("submit", engine_pb2.EngineRequest(request_id="r"))
        # The consumer is busy elsewhere while all 51 messages arrive: it then takes two items,
        # the 50 plain tokens folded into one, and the final chunk (never merged: it ends the request).
        await asyncio.wait_for(_until(lambda: mux.items_received == 51), 10)
        items = await inbox.get_ready()
        assert [item["tokens"] for item in items] == [list(range(50)), [50]]
        assert [item["finished"] for item in items] == [False, True]
    finally:
        await mux.close()
        await channel.close()
        await server.stop(None)


async def _until(condition: Any) -> None:
    from tests.waiting import poll
    await poll(condition, timeout=10)


async def test_a_lagging_loop_defers_wake_ups_and_an_idle_one_does_not() -> None:
    from services.mux import _Waker

    loop = asyncio.get_running_loop()
    for lag, expect_deferred in ((0.0, False), (1.0, True)):
        waker = _Waker(max_delay=0.05)
        waker.lag = lag
        inbox: Inbox[int] = Inbox()
        consumer = asyncio.create_task(inbox.get_ready())
        await asyncio.sleep(0)                       # parked on its waiter
        t0 = loop.time()
        assert inbox.append(1)
        waker.add(inbox)
        assert inbox.append(2) and waker.flushes == 0   # still waiting: the flush is pending
        assert await consumer == [1, 2]
        waited = loop.time() - t0
        assert (waited >= 0.045) is expect_deferred, (lag, waited)
        assert waker.flushes == 1


async def test_while_the_loop_is_behind_a_sink_is_not_called_and_chunks_merge() -> None:
    # Found by a pinned relay run (docs/benchmarks.md): with the engine stage's sink called for
    # every chunk, a saturated router sent one token per client message (1.0-1.4 tokens per
    # message, 11k tokens per router CPU-second at 256 streams where it had relayed 80k): the merge
    # that made deltas fuller under load never ran.
    server, address = await _serve(_DripEngine(tokens=51))
    channel, mux = _merging_client(address, wake_delay=0.005)
    mux._waker.probe = lambda loop: None        # type: ignore[method-assign]  # the lag is set by hand here
    try:
        for lag, expect_sunk in ((0.0, 50), (1.0, 0)):
            mux._waker.lag = lag                # as measured on its own wake-ups by the reader
            sunk: list[list[int]] = []
            inbox = mux.open(f"r{lag}")

            def sink(item: Any, sunk: list[list[int]] = sunk, lag: float = lag) -> bool:
                if item["finished"]:
                    return False
                sunk.append(item["tokens"])
                mux._waker.lag = lag            # the reader's flushes would measure the idle loop here
                return True
            inbox.sink = sink
            mux.post("submit", engine_pb2.EngineRequest(request_id=f"r{lag}"))
            items: list[Any] = []
            while not (items and items[-1]["finished"]):
                items += await asyncio.wait_for(inbox.get_ready(), 10)
            assert len(sunk) == expect_sunk, (lag, len(sunk))
            received = [t for s in sunk for t in s] + [t for item in items for t in item["tokens"]]
            assert received == list(range(51))
            if lag:                  # through the inbox, where chunks that wait merge (tested above)
                assert len(items) < 51
            mux.release(f"r{lag}")
    finally:
        await mux.close()
        await channel.close()
        await server.stop(None)


@pytest.mark.parametrize("hogging,wake_delay", [("sleeps", 0.005), ("spins", 0.005), ("spins", 0.0)])
async def test_a_reader_whose_sink_takes_everything_still_sees_the_loop_fall_behind(hogging: str,
                                                                                    wake_delay: float) -> None:
    # Found by local relay runs at 256 streams: some runs relayed 1.1 tokens per client message and
    # 9k tokens per router CPU-second where the others made 8-17 and 17-30k. The lag was measured on
    # the waker's flushes only, and while sinks take every plain chunk there are none but a
    # request's last: with long replies the lag stayed at its idle value, sinks went on being
    # called for every token, and the loop fell further behind (a state it could not leave).
    # With no deferral (wake_delay 0) nothing would merge: the sink stays on, saving its task hop.
    server, address = await _serve(_DripEngine(tokens=1000))
    channel, mux = _merging_client(address, wake_delay)
    busy = True

    async def hog() -> None:
        while busy:
            if hogging == "sleeps":      # a loop turn takes a few ms: a lag every probe sees
                time.sleep(0.003)  # noqa: ASYNC251  (blocking on purpose: a busy loop)
            else:                        # short turns, but no idle time: the process is saturated
                spin = time.perf_counter() + 0.0003
                while time.perf_counter() < spin:
                    pass
            await asyncio.sleep(0)

    hogger = asyncio.create_task(hog())
    try:
        sunk: list[list[int]] = []
        received: list[int] = []         # what the consumer gets, sunk or taken, in the order it gets it
        inbox = mux.open("r")

        def sink(item: Any) -> bool:
            if item["finished"]:
                return False
            sunk.append(item["tokens"])
            received.extend(item["tokens"])
            return True
        inbox.sink = sink
        mux.post("submit", engine_pb2.EngineRequest(request_id="r"))
        items: list[Any] = []

        async def consume() -> None:    # as the engine stage does: what it takes, it hands on in the same step
            while not (items and items[-1]["finished"]):
                taken = await inbox.get_ready()
                items.extend(taken)
                received.extend(t for item in taken for t in item["tokens"])
        await asyncio.wait_for(consume(), 30)
        assert received == list(range(1000))
        assert mux._waker.behind
        if hogging == "sleeps":
            assert mux.loop_lag > 0.001
        else:                            # short turns (a lag may still show on a crowded host)
            assert mux._waker.saturated
        if wake_delay:
            # behind (seen within a 50 ms window or a few probes): the rest went to the inbox and merged
            assert len(sunk) < 400, len(sunk)
        else:
            assert len(sunk) == 999, len(sunk)
    finally:
        busy = False
        await hogger
        await mux.close()
        await channel.close()
        await server.stop(None)
