"""Client side of a multiplexed bidirectional stream (many requests, one gRPC stream).

The engine's `Stream` and the tokenizer's `Detokenize` both carry many requests per message in
both directions, because one Python gRPC message costs ~100 µs of CPU. `MuxClient` owns one such
stream: callers `post()` items, a sender coalesces every item posted since its last write into
one request message, and a reader fans response items out to per-request queues by request id.
If the stream breaks, every open request receives a `StreamBroken` marker carrying a typed
error, and the next `open()` starts a new stream.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import grpc

from services.errors import Reason, TokenrelayError, from_rpc_error

Item = TypeVar("Item")


@dataclass(frozen=True)
class StreamBroken:
    error: TokenrelayError


class MuxClient(Generic[Item]):
    """One multiplexed stream.

    ``open_call(request_iterator)`` starts the gRPC call; ``build(pending)`` turns a dict of
    field name → list of posted items into one request message; ``split(response)`` yields
    ``(request_id, item)`` pairs of a response message.
    """

    def __init__(self, name: str, open_call: Callable[[AsyncIterator[Any]], Any],
                 build: Callable[[dict[str, list[Any]]], Any],
                 split: Callable[[Any], list[tuple[str, Item]]]) -> None:
        self.name = name
        self._open_call = open_call
        self._build = build
        self._split = split
        self._pending: dict[str, list[Any]] = {}
        self._wake = asyncio.Event()
        self._queues: dict[str, asyncio.Queue[Item | StreamBroken]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._closed = False
        self.messages_sent = 0
        self.messages_received = 0

    # -- request side -------------------------------------------------------------------------
    def open(self, request_id: str) -> asyncio.Queue[Item | StreamBroken]:
        """Register a request; its response items arrive on the returned queue."""
        if self._closed:
            raise Reason.UPSTREAM_UNAVAILABLE.error(f"{self.name} client is closed")
        if self._reader is None or self._reader.done():
            self._start()
        queue: asyncio.Queue[Item | StreamBroken] = asyncio.Queue()
        self._queues[request_id] = queue
        return queue

    def release(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    def post(self, field: str, item: Any) -> None:
        """Queue one item for the next outbound message (never blocks)."""
        self._pending.setdefault(field, []).append(item)
        self._wake.set()

    @property
    def open_requests(self) -> int:
        return len(self._queues)

    # -- stream plumbing ----------------------------------------------------------------------
    def _start(self) -> None:
        self._pending.clear()
        self._wake = asyncio.Event()
        call = self._open_call(self._outbound())
        self._reader = asyncio.create_task(self._read(call), name=f"mux-reader-{self.name}")

    async def _outbound(self) -> AsyncIterator[Any]:
        while not self._closed:
            await self._wake.wait()
            self._wake.clear()
            pending, self._pending = self._pending, {}
            if pending:
                self.messages_sent += 1
                yield self._build(pending)

    async def _read(self, call: Any) -> None:
        error: TokenrelayError = Reason.UPSTREAM_UNAVAILABLE.error(f"{self.name} stream ended")
        try:
            async for response in call:
                self.messages_received += 1
                for request_id, item in self._split(response):
                    queue = self._queues.get(request_id)
                    if queue is not None:
                        queue.put_nowait(item)
        except grpc.aio.AioRpcError as exc:
            error = from_rpc_error(exc)
            if error.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                error = Reason.UPSTREAM_UNAVAILABLE.error(f"{self.name} stream broke: {exc.details()}")
        except asyncio.CancelledError:
            call.cancel()
            raise
        finally:
            broken = StreamBroken(error)
            for queue in self._queues.values():
                queue.put_nowait(broken)
            self._queues.clear()

    async def close(self) -> None:
        self._closed = True
        self._wake.set()
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader
