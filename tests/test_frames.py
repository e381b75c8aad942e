"""services/frames.py over real loopback sockets: framed protobuf streams, their ends, their errors and
their bounds. The engine's use of them is in tests/engine/test_engine_frames.py."""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import AsyncIterator

import pytest

from services import frames
from services.errors import Reason, TokenrelayError
from services.frames import END, ERROR, HEADER, MAGIC, MESSAGE, FrameCall, FrameServer, FrameStream, frame
from services.proto.tokenrelay.v1 import engine_pb2

Inbound = engine_pb2.EngineInbound
Outbound = engine_pb2.EngineOutbound


async def _requests(*ids: str, hold: asyncio.Event | None = None) -> AsyncIterator[Inbound]:
    for rid in ids:
        yield Inbound(abort=[rid])
    if hold is not None:
        await hold.wait()


def _echo(seen: list[str], ended: list[str]):
    async def handler(stream: FrameStream) -> None:
        async for m in stream.messages(Inbound.FromString):
            seen.extend(m.abort)
            await stream.send(Outbound(chunks=[engine_pb2.TokenChunk(request_id=r) for r in m.abort]))
        ended.append("lost" if stream.lost else "end")
    return handler


async def _server(handler) -> FrameServer:
    server = FrameServer("127.0.0.1", 0, handler, name="test")
    await server.start()
    return server


async def test_messages_go_both_ways_and_a_half_close_ends_the_stream_cleanly() -> None:
    seen: list[str] = []
    ended: list[str] = []
    server = await _server(_echo(seen, ended))
    try:
        call = FrameCall("127.0.0.1", server.port, _requests("a", "b", "c"), Outbound.FromString)
        got = [c.request_id async for m in call for c in m.chunks]
        assert got == ["a", "b", "c"] and seen == ["a", "b", "c"]
        assert ended == ["end"]           # the client's END reached the handler as the end of its messages
    finally:
        await server.stop()


async def test_a_handlers_typed_error_reaches_the_client_with_its_reason() -> None:
    async def handler(stream: FrameStream) -> None:
        async for _ in stream.messages(Inbound.FromString):
            raise Reason.OVERLOADED.error("too busy", retry_after=1.0)

    server = await _server(handler)
    try:
        call = FrameCall("127.0.0.1", server.port, _requests("a"), Outbound.FromString)
        with pytest.raises(TokenrelayError) as info:
            async for _ in call:
                pass
        assert info.value.reason == Reason.OVERLOADED and "too busy" in info.value.message
    finally:
        await server.stop()


async def test_an_unexpected_handler_failure_is_internal_not_a_hang() -> None:
    async def handler(stream: FrameStream) -> None:
        raise RuntimeError("bug")

    server = await _server(handler)
    try:
        call = FrameCall("127.0.0.1", server.port, _requests(), Outbound.FromString)
        with pytest.raises(TokenrelayError) as info:
            await asyncio.wait_for(_drain(call), 5)
        assert info.value.reason == Reason.INTERNAL
    finally:
        await server.stop()


async def _drain(call: FrameCall) -> None:
    async for _ in call:
        pass


async def test_a_refused_connection_is_upstream_unavailable_and_is_told() -> None:
    with socket.socket() as s:          # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    failed: list[BaseException] = []
    call = FrameCall("127.0.0.1", port, _requests("a"), Outbound.FromString, on_unusable=failed.append)
    with pytest.raises(TokenrelayError) as info:
        await _drain(call)
    assert info.value.reason == Reason.UPSTREAM_UNAVAILABLE and info.value.retryable
    assert len(failed) == 1


async def test_a_refused_connection_with_a_fallback_is_the_fallbacks_call() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    taken: list[list[str]] = []

    async def fallback_call(requests: AsyncIterator[Inbound]) -> AsyncIterator[Outbound]:
        ids = [rid async for m in requests for rid in m.abort]   # the requests reach the fallback, all of them
        taken.append(ids)
        yield Outbound(chunks=[engine_pb2.TokenChunk(request_id=r) for r in ids])

    failed: list[BaseException] = []
    call = FrameCall("127.0.0.1", port, _requests("a", "b"), Outbound.FromString, on_unusable=failed.append,
                     fallback=fallback_call)
    got = [c.request_id async for m in call for c in m.chunks]
    assert got == ["a", "b"] and taken == [["a", "b"]] and len(failed) == 1


async def test_a_server_gone_mid_stream_is_upstream_unavailable() -> None:
    started = asyncio.Event()

    async def handler(stream: FrameStream) -> None:
        started.set()
        await asyncio.sleep(3600)

    server = await _server(handler)
    call = FrameCall("127.0.0.1", server.port, _requests("a", hold=asyncio.Event()), Outbound.FromString)
    task = asyncio.create_task(_drain(call))
    await asyncio.wait_for(started.wait(), 5)
    await server.stop()                  # cancels the handler, closes the connection
    with pytest.raises(TokenrelayError) as info:
        await asyncio.wait_for(task, 5)
    assert info.value.reason == Reason.UPSTREAM_UNAVAILABLE


async def test_a_cancelled_call_is_a_lost_stream_on_the_server() -> None:
    seen: list[str] = []
    ended: list[str] = []
    server = await _server(_echo(seen, ended))
    try:
        call = FrameCall("127.0.0.1", server.port, _requests("a", hold=asyncio.Event()), Outbound.FromString)
        it = aiter(call)
        first = await asyncio.wait_for(anext(it), 5)
        assert first.chunks[0].request_id == "a"
        call.cancel()
        await asyncio.wait_for(_until(lambda: ended), 5)
        assert ended == ["lost"] and server.connections == 0
    finally:
        await server.stop()


async def _until(cond) -> None:
    while not cond():
        await asyncio.sleep(0.01)


async def _raw(port: int, data: bytes) -> list[tuple[int, bytes]]:
    """Send raw bytes, read frames until the server closes the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    got: list[tuple[int, bytes]] = []
    try:
        while True:
            got.append(await asyncio.wait_for(frames.read_frame(reader), 5))
    except asyncio.IncompleteReadError:
        pass
    finally:
        writer.close()
    return got


@pytest.mark.parametrize("data, why", [
    (b"GET / HTTP/1.1\r\n\r\n", "not a tokenrelay frame stream"),
    (MAGIC + HEADER.pack(frames.MAX_FRAME_BYTES + 1, MESSAGE), "at most"),
    (MAGIC + HEADER.pack(0, 7), "unknown frame kind"),
    (MAGIC + frame(MESSAGE, b"\xff\xff\xff\xff"), "does not decode"),
    (MAGIC + frame(ERROR, b"x"), "ERROR frame"),
])
async def test_bad_input_gets_a_typed_error_frame_and_the_connection_closed(data: bytes, why: str) -> None:
    server = await _server(_echo([], []))
    try:
        got = await _raw(server.port, data)
        assert [k for k, _ in got] == [ERROR]
        reason, _, message = got[0][1].decode().partition("\0")
        assert reason == Reason.MALFORMED_MESSAGE and why in message
        await asyncio.wait_for(_until(lambda: server.connections == 0), 5)
    finally:
        await server.stop()


async def test_a_connection_that_never_says_hello_is_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(frames, "HELLO_TIMEOUT", 0.2)
    server = await _server(_echo([], []))
    try:
        got = await asyncio.wait_for(_raw(server.port, b""), 5)
        assert got == [] and server.connections == 0
    finally:
        await server.stop()


async def test_a_server_error_frame_with_an_unknown_reason_keeps_its_name() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readexactly(len(MAGIC))
        writer.write(frame(ERROR, b"SOMETHING_NEW\0from a newer engine"))
        await writer.drain()
        writer.close()

    raw = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = raw.sockets[0].getsockname()[1]
    try:
        with pytest.raises(TokenrelayError) as info:
            await _drain(FrameCall("127.0.0.1", port, _requests(), Outbound.FromString))
        assert info.value.reason == "SOMETHING_NEW"
    finally:
        raw.close()


@pytest.mark.parametrize("answer", [
    b"HTTP/1.1 400 Bad Request\r\n\r\n",                  # another program on the port
    b"\x00\x00\x12\x04\x00\x00\x00\x00\x00",         # an HTTP/2 (gRPC) server's SETTINGS frame
    frame(MESSAGE, b"\xff\xff\xff"),                       # a message that does not decode
])
async def test_a_server_that_is_not_a_frame_stream_is_retryable_and_told(answer: bytes) -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(answer)
        await writer.drain()
        await asyncio.sleep(1)
        writer.close()

    raw = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = raw.sockets[0].getsockname()[1]
    told: list[BaseException] = []
    try:
        with pytest.raises(TokenrelayError) as info:
            await asyncio.wait_for(_drain(FrameCall("127.0.0.1", port, _requests("a"), Outbound.FromString,
                                                    on_unusable=told.append)), 5)
        # never a client error (MALFORMED_MESSAGE) for what the server sent: retried elsewhere instead
        assert info.value.reason == Reason.UPSTREAM_UNAVAILABLE and info.value.retryable, info.value
        assert len(told) == 1
    finally:
        raw.close()


async def test_stop_gives_open_streams_their_grace_then_cancels_them() -> None:
    finished = asyncio.Event()

    async def handler(stream: FrameStream) -> None:
        try:
            await asyncio.sleep(0.2)
            await stream.send(Outbound())
        finally:
            finished.set()

    server = await _server(handler)
    call = FrameCall("127.0.0.1", server.port, _requests(hold=asyncio.Event()), Outbound.FromString)
    task = asyncio.create_task(_drain(call))
    await asyncio.wait_for(_until(lambda: server.connections == 1), 5)
    await server.stop(grace=5)           # the handler ends by itself within its grace
    assert finished.is_set()
    await asyncio.wait_for(task, 5)      # and the client saw a clean END
    with pytest.raises(OSError):         # no longer accepting
        await asyncio.open_connection("127.0.0.1", server.port)


def test_header_layout() -> None:
    assert frame(END) == struct.pack("!IB", 0, END)
    assert frame(MESSAGE, b"ab") == struct.pack("!IB", 2, MESSAGE) + b"ab"
