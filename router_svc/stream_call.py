"""Many generations on one open call (the `Stream` RPC): submits and cancels in, batches of events out.

A service-to-service caller keeps one call open and puts its requests on it: no call is set up per
request (a new grpc.aio call's first message took 1.7-1.8 ms against 0.75-0.9 ms for a message on an
open stream, on a 2-core VM; docs/architecture.md, "The Stream API"), and each response carries every
event that is ready for any of the call's requests, so one write serves many requests under load.

Each request runs through `Router.generate` as a Generate call's would (the same validation, id
claim, admission, deadline, retries and metrics); its deadline is its own `timeout_ms` after its
arrival, bounded by the call's. What fails one request (a refusal, a bad field, a missing or
duplicate id, the call's request limit) is that request's `error` event; the call and its other
requests go on. What ends the call: a message that does not decode (INVALID_ARGUMENT,
MALFORMED_MESSAGE, before this module), or the client going away: its requests are cancelled, their
engine work aborted and their leases released. A half-close ends the call once its requests are done.

Bounded: at most `max_requests` requests in flight per call (more are refused STREAM_FULL); a
request's unwritten deltas are merged into one, so what waits for a slow reader is at most one
delta per request and its few other events.

This module imports no gRPC: the servicer converts messages.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from services.errors import Reason, TokenrelayError
from services.logging import get_logger

from .chat import turn_error
from .pipeline import Router
from .tenants import Tenant
from .types import Delta, Event, GenerateInput, TurnError
from .validation import MAX_REQUEST_ID

log = get_logger(__name__)

StreamOut = tuple[str, "Event | TurnError"]


@dataclass
class StreamSubmit:
    inp: GenerateInput
    timeout: float | None = None     # seconds after its arrival; None = the call's deadline


@dataclass
class StreamIn:
    """One inbound message: its new requests and cancels, and when it was read."""

    arrived: float
    submits: list[StreamSubmit] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)


class _MergedDelta:
    """A request's deltas not yet written, kept as parts (joined once, when the batch is taken)."""

    __slots__ = ("at", "first", "parts")

    def __init__(self, at: int, first: Delta) -> None:
        self.at, self.first = at, first
        self.parts: list[Delta] = []

    def add(self, delta: Delta) -> None:
        self.parts.append(delta)

    def delta(self) -> Delta:
        deltas = [self.first, *self.parts]
        return Delta("".join(d.text for d in deltas), [i for d in deltas for i in d.token_ids])


class _Call:
    def __init__(self, router: Router, tenant: Tenant, call_deadline: float | None, max_requests: int) -> None:
        self.router, self.tenant = router, tenant
        self.call_deadline = call_deadline
        self.max_requests = max_requests
        self.live: dict[str, asyncio.Task[None]] = {}
        self.out: list[StreamOut] = []
        self._merged: dict[str, _MergedDelta] = {}   # request id -> its unwritten delta in `out`
        self.wake = asyncio.Event()
        self.reading = True
        self.failure: Exception | None = None
        self._cancels: set[asyncio.Task[None]] = set()
        self._cancelling: set[str] = set()

    def emit(self, request_id: str, event: Event | TurnError) -> None:
        if type(event) is Delta:
            merged = self._merged.get(request_id)
            if merged is not None:   # not written yet: this request's deltas ready together go as one
                merged.add(event)
                return
            self._merged[request_id] = _MergedDelta(len(self.out), event)
        else:                        # deltas after this event must not be merged into one before it
            self._seal(request_id)
        self.out.append((request_id, event))
        self.wake.set()

    def _seal(self, request_id: str) -> None:
        merged = self._merged.pop(request_id, None)
        if merged is not None and merged.parts:
            self.out[merged.at] = (request_id, merged.delta())

    def take(self) -> list[StreamOut]:
        for request_id in list(self._merged):
            self._seal(request_id)
        batch, self.out = self.out, []
        self.wake.clear()
        return batch

    @property
    def finished(self) -> bool:
        return not self.reading and not self.live and not self.out

    async def _run(self, request_id: str, inp: GenerateInput, deadline: float | None, arrived: float) -> None:
        try:
            async for event in self.router.generate(self.tenant, inp, deadline, arrived):
                self.emit(request_id, event)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - this request fails; the call goes on
            self.emit(request_id, turn_error(exc, request_id))
        finally:
            self.live.pop(request_id, None)
            self.wake.set()

    def _deadline(self, s: StreamSubmit, arrived: float) -> float | None:
        own = arrived + s.timeout if s.timeout else None
        if own is None or self.call_deadline is None:
            return own if own is not None else self.call_deadline
        return min(own, self.call_deadline)

    def _refuse(self, request_id: str, error: TokenrelayError) -> None:
        self.emit(request_id, turn_error(error, request_id))

    def submit(self, s: StreamSubmit, arrived: float) -> None:
        rid = s.inp.request_id
        if not rid:
            return self._refuse("", Reason.MISSING_REQUEST_ID.error(
                "every request on a Stream call needs its request_id: its events and cancels name it"))
        if len(rid) > MAX_REQUEST_ID:
            return self._refuse("", Reason.INVALID_REQUEST_ID.error(f"request_id longer than {MAX_REQUEST_ID}"))
        if rid in self.live:
            return self._refuse(rid, Reason.DUPLICATE_REQUEST_ID.error(
                "request_id already in flight on this call (the request in flight goes on)"))
        if len(self.live) >= self.max_requests:
            return self._refuse(rid, Reason.STREAM_FULL.error(
                f"this call already has {self.max_requests} requests in flight"))
        self.live[rid] = asyncio.create_task(self._run(rid, s.inp, self._deadline(s, arrived), arrived))

    async def _cancel(self, request_id: str) -> None:
        try:
            await self.router.cancel(self.tenant, request_id)
        except TokenrelayError as exc:   # the cancel could not be confirmed (Redis): end it here
            task = self.live.get(request_id)
            if task is not None and not task.done():
                task.cancel()
                self.emit(request_id, turn_error(Reason.CANCELLED.error(f"cancelled ({exc.reason})"), request_id))
        finally:
            self._cancelling.discard(request_id)

    def cancel(self, request_id: str) -> None:
        # One cancel per live request at a time, however often the client names it.
        if request_id in self.live and request_id not in self._cancelling:
            self._cancelling.add(request_id)
            task = asyncio.create_task(self._cancel(request_id))
            self._cancels.add(task)
            task.add_done_callback(self._cancels.discard)

    async def read(self, incoming: AsyncIterator[StreamIn]) -> None:
        try:
            async for msg in incoming:
                for rid in msg.cancels:
                    self.cancel(rid)
                for s in msg.submits:
                    self.submit(s, msg.arrived)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - e.g. a message that does not decode: ends the call
            self.failure = exc
        finally:
            self.reading = False
            self.wake.set()

    async def close(self, reader: asyncio.Task[None]) -> None:
        tasks = [reader, *self.live.values(), *self._cancels]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


async def run_stream(router: Router, tenant: Tenant, incoming: AsyncIterator[StreamIn], *,
                     call_deadline: float | None = None, max_requests: int = 1024) -> AsyncIterator[list[StreamOut]]:
    """Yield every event ready, as one batch per write, until the client half-closes and its
    requests are done. Closing this generator (the client went away) cancels what is in flight."""
    call = _Call(router, tenant, call_deadline, max_requests)
    reader = asyncio.create_task(call.read(incoming))
    try:
        while True:
            await call.wake.wait()
            batch = call.take()
            if batch:
                yield batch
            if call.failure is not None:
                raise call.failure
            if call.finished:
                return
    finally:
        await call.close(reader)
