"""Framed protobuf streams over a plain TCP connection: the engine's `Stream` without gRPC.

Why: at light load one small message each way over an open grpc.aio stream takes ~1.1 ms between two
processes on the 2-core development machine, against ~0.35 ms over asyncio's own streams on the same
loopback (`docs/relay/2026-12-07c/cpu/pingpong.py`). A gRPC message crosses three threads on each side
(gRPC's poller, its completion queue's thread, the event loop); a frame is read by the event loop
itself. The router's first token crosses the engine's stream twice (the submit out, the first chunk
back), so this is time every request's TTFT pays (docs/architecture.md, "The engine's frame port").

The engine's gRPC `Stream` stays the contract and the fallback: an engine with a frame port says so in
its load reports (`LoadReport.frame_port`); a router whose engine channels are plaintext opens the
multiplexed stream there instead, with the same messages (`EngineInbound` out, `EngineOutbound` back)
and the same semantics (a half-close ends the stream once its requests are done; a connection lost is
a cancelled call: the engine aborts the stream's requests). Plaintext only: an engine whose port is
TLS or mTLS opens no frame port (its settings refuse one), and a router with secured engine channels
never dials one, so nothing is ever downgraded.

The wire: the client opens with `MAGIC`; then both ways a frame is a header (`!IB`: payload length,
kind) and the payload. Kinds: `MESSAGE` (a serialized protobuf message), `END` (from the client: no
more messages, a half-close; from the server: the stream ended cleanly), `ERROR` (server only: the
stream failed; the payload is ``reason`` NUL ``message`` in UTF-8). A payload larger than
`MAX_FRAME_BYTES` (gRPC's message limit here), an unknown kind or a wrong magic ends the connection:
the server answers with an ERROR frame (MALFORMED_MESSAGE) where it can.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Generic, Protocol, TypeVar

from services.channels import MAX_MESSAGE_BYTES
from services.errors import Reason, TokenrelayError, error_for
from services.logging import get_logger

log = get_logger(__name__)

MAGIC = b"TRF1"
HEADER = struct.Struct("!IB")
MESSAGE, END, ERROR = 0, 1, 2
MAX_FRAME_BYTES = MAX_MESSAGE_BYTES
CONNECT_TIMEOUT = 2.0      # seconds to open a connection (a refused one fails at once)
HELLO_TIMEOUT = 10.0       # seconds a server waits for a new connection's magic


class Message(Protocol):
    def SerializeToString(self) -> bytes: ...   # protobuf's name


M = TypeVar("M")


def frame(kind: int, payload: bytes = b"") -> bytes:
    return HEADER.pack(len(payload), kind) + payload


def error_frame(error: TokenrelayError) -> bytes:
    return frame(ERROR, f"{error.reason}\0{error.message}".encode()[:MAX_FRAME_BYTES])


def _error_from(payload: bytes) -> TokenrelayError:
    reason, _, message = payload.decode("utf-8", "replace").partition("\0")
    return error_for(reason or Reason.UPSTREAM_UNAVAILABLE.value, message)


async def read_frame(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """One frame (kind, payload). Raises MALFORMED_MESSAGE for an oversized payload or an unknown
    kind, `asyncio.IncompleteReadError` at the end of the connection."""
    length, kind = HEADER.unpack(await reader.readexactly(HEADER.size))
    if length > MAX_FRAME_BYTES:
        raise Reason.MALFORMED_MESSAGE.error(f"frame of {length} bytes (at most {MAX_FRAME_BYTES})")
    if kind not in (MESSAGE, END, ERROR):
        raise Reason.MALFORMED_MESSAGE.error(f"unknown frame kind {kind}")
    return kind, await reader.readexactly(length) if length else b""


def _parse(parse: Callable[[bytes], M], payload: bytes) -> M:
    try:
        return parse(payload)
    except Exception as exc:   # protobuf's DecodeError and friends: the peer sent garbage
        raise Reason.MALFORMED_MESSAGE.error(f"a frame that does not decode: {exc}") from exc


# ------------------------------------------------------------------------------------------ client
class FrameCall(Generic[M]):
    """A client stream with the part of a grpc.aio stream-stream call `services.mux.MuxClient` uses:
    iterate it for the responses (parsed with ``parse``), ``cancel()`` it. It connects when first
    iterated, writes every message of ``requests`` as it comes and an END frame when they run out.
    Failures raise `TokenrelayError`: UPSTREAM_UNAVAILABLE for a connection that cannot be opened, is
    lost or carries what is not a frame stream; the server's own reason for an ERROR frame.
    ``on_unusable`` hears a port that is no frame stream: the connection could not be opened, spoke
    something else, or closed before its first frame;
    then, with a ``fallback``, the call is ``fallback(requests)`` instead (the router's gRPC call:
    nothing was sent yet, so no request is lost), and its responses and failures are this call's."""

    def __init__(self, host: str, port: int, requests: AsyncIterator[Message], parse: Callable[[bytes], M],
                 *, what: str = "frames", on_unusable: Callable[[BaseException], None] | None = None,
                 fallback: Callable[[Any], Any] | None = None,
                 connect_timeout: float = CONNECT_TIMEOUT) -> None:
        self._host, self._port = host, port
        self._requests = requests
        self._parse = parse
        self._what = what
        self._on_unusable = on_unusable
        self._fallback = fallback
        self._instead: Any = None          # the fallback's call, once it took over
        self._connect_timeout = connect_timeout
        self._writer: asyncio.StreamWriter | None = None
        self._sender: asyncio.Task[None] | None = None
        self._cancelled = False

    def cancel(self) -> bool:
        self._cancelled = True
        if self._instead is not None:
            self._instead.cancel()
        if self._sender is not None:
            self._sender.cancel()
        if self._writer is not None:
            self._writer.close()
        return True

    def _unusable(self, exc: BaseException) -> None:
        if self._on_unusable is not None:
            self._on_unusable(exc)

    def _lost(self, why: object) -> TokenrelayError:
        return Reason.UPSTREAM_UNAVAILABLE.error(f"{self._what} {self._host}:{self._port}: {why}")

    async def _send(self, writer: asyncio.StreamWriter) -> None:
        try:
            async for message in self._requests:
                writer.write(frame(MESSAGE, message.SerializeToString()))
                await writer.drain()
            writer.write(frame(END))
            await writer.drain()
        except (ConnectionError, OSError):
            writer.close()     # the reader sees the connection end and reports it

    def __aiter__(self) -> AsyncIterator[M]:
        return self._responses()

    async def _responses(self) -> AsyncIterator[M]:
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(self._host, self._port),
                                                    self._connect_timeout)
        except (OSError, asyncio.TimeoutError) as exc:
            self._unusable(exc)
            if self._fallback is None or self._cancelled:
                raise self._lost(f"cannot connect: {exc or type(exc).__name__}") from exc
            self._instead = self._fallback(self._requests)
            async for response in self._instead:
                yield response
            return
        self._writer = writer
        if self._cancelled:
            writer.close()
            raise asyncio.CancelledError
        writer.write(MAGIC)
        self._sender = asyncio.create_task(self._send(writer), name=f"frames-send-{self._what}")
        try:
            framed = False          # a well-formed frame came back on this connection
            while True:
                try:
                    kind, payload = await read_frame(reader)
                    message = _parse(self._parse, payload) if kind == MESSAGE else None
                except (asyncio.IncompleteReadError, ConnectionError, OSError) as exc:
                    if not framed and not self._cancelled:
                        self._unusable(exc)     # closed on us before a frame: not a frame port
                    raise self._lost("connection lost") from exc
                except TokenrelayError as exc:
                    # The server broke the protocol (another program on that port, say): not the
                    # requests' fault. Retryable, and the port is left alone like one that refuses.
                    self._unusable(exc)
                    raise self._lost(f"not a tokenrelay frame stream: {exc.message}") from exc
                framed = True
                if message is not None:
                    yield message
                elif kind == END:
                    return
                else:
                    raise _error_from(payload)
        finally:
            self.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._sender


# ------------------------------------------------------------------------------------------ server
class FrameStream:
    """The server side of one connection: `messages(parse)` iterates the client's messages until its
    END (a clean end) or the connection's loss (`lost` is then True: a cancelled call); `send`
    writes one message (waiting while the client does not read)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self.lost = False

    async def messages(self, parse: Callable[[bytes], M]) -> AsyncIterator[M]:
        while True:
            try:
                kind, payload = await read_frame(self._reader)
            except (asyncio.IncompleteReadError, ConnectionError, OSError):
                self.lost = True
                return
            if kind == END:
                return
            if kind != MESSAGE:
                raise Reason.MALFORMED_MESSAGE.error("a client sent an ERROR frame")
            yield _parse(parse, payload)

    async def send(self, message: Message) -> None:
        self._writer.write(frame(MESSAGE, message.SerializeToString()))
        await self._writer.drain()


Handler = Callable[[FrameStream], Awaitable[None]]


class FrameServer:
    """A TCP port that serves framed streams: ``handler(stream)`` runs once per connection; when it
    returns the stream ends with END, when it raises a `TokenrelayError` with ERROR (its reason), and
    anything else is logged and ends it with ERROR (INTERNAL). `stop(grace)` stops accepting at once
    and gives the open streams ``grace`` seconds before it cancels their handlers."""

    def __init__(self, host: str, port: int, handler: Handler, *, name: str = "frames") -> None:
        self._host, self._port = host, port
        self._handler = handler
        self._name = name
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[Any]] = set()
        self.port = 0

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._accept, self._host, self._port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    @property
    def connections(self) -> int:
        return len(self._connections)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            await self._serve(reader, writer)
        finally:
            self._connections.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            hello = await asyncio.wait_for(reader.readexactly(len(MAGIC)), HELLO_TIMEOUT)
        except (asyncio.IncompleteReadError, asyncio.TimeoutError, ConnectionError, OSError):
            return
        if hello != MAGIC:
            writer.write(error_frame(Reason.MALFORMED_MESSAGE.error("not a tokenrelay frame stream")))
            return
        stream = FrameStream(reader, writer)
        try:
            await self._handler(stream)
            if not stream.lost:
                writer.write(frame(END))
        except TokenrelayError as exc:
            writer.write(error_frame(exc))
        except (ConnectionError, OSError):
            pass        # the client went away while we wrote: the handler's own cleanup ran
        except Exception as exc:
            log.exception("frame_stream_failed", server=self._name)
            writer.write(error_frame(Reason.INTERNAL.error(f"{type(exc).__name__}")))
        with contextlib.suppress(ConnectionError, OSError):
            await writer.drain()

    async def stop(self, grace: float = 0.0) -> None:
        if self._server is not None:
            self._server.close()
        if self._connections and grace > 0:
            await asyncio.wait(set(self._connections), timeout=grace)
        for task in list(self._connections):
            task.cancel()
        for task in list(self._connections):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
