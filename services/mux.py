"""Client side of a multiplexed bidirectional stream (many requests, one gRPC stream).

The engine's `Stream` and the tokenizer's `Detokenize` both carry many requests per message in
both directions, because one Python gRPC message costs ~100 µs of CPU. `MuxClient` owns one such
stream: callers `post()` items, a sender coalesces every item posted since its last write into
one request message, and a reader fans response items out to per-request inboxes by request id.
If the stream breaks, every open request receives a `StreamBroken` marker carrying a typed
error, and the next `open()` starts a new stream.

An `Inbox` is a plain buffer plus at most one waiter: the reader appends every item of a
response message and wakes the request's consumer once (an `asyncio.Queue` costs a `call_soon`
per item, the commonest asyncio cost in the router's profile); the consumer then takes
everything that is ready with `get_ready()`, so a burst of chunks costs one task hop.

Wake-ups under load (`max_wake_delay`): an upstream that produces faster than the loop consumes sends
many small messages (one token per request each) that queue in gRPC's buffers; woken per message, every
consumer runs its whole per-request path once per token, and the backlog grows. So the reader watches
the loop three ways: the lag of its own wake-ups, the lag of a timed `call_soon` in each loop turn a
message arrived in, and the loop's busy share over 50 ms windows (the time it does not wait in its
selector, `services/loopidle.py`; on a loop without one, such as uvloop, CPU time: the loop thread's own
at `_BUSY_SHARE` of a core, or at `_LOOP_SHARE` while the whole process uses `_BUSY_SHARE` of the CPUs
it may use — a loop pinned to one core with gRPC's threads shares it with them and never reaches 90% of
it alone). With the first alone, sinks taking every item left nothing to measure and the lag stale at
its idle value: a saturated router then relayed one token per client message and could not get out of
that state. While the lag is below `_BUSY_LAG` and the loop not saturated, consumers are woken at once
(the next loop turn: nothing waits when idle); once it is above, wake-ups are deferred by
`max_wake_delay`, the reader takes the messages that arrive meanwhile and each consumer takes all of
them in one turn: fewer, fuller messages downstream, at most one per request per `max_wake_delay`. A
request's first item is never deferred (time to first token). A flush wakes every consumer that got
items in one loop turn. Waking them a slice (16) per turn, so that a new call or a refusal would wait
for one slice and not a whole batch's, was tried and dropped: on the 16-core host it did not change the
overload bench's refusal p99 beyond noise (15.3 vs 18.1 ms with 2 routers, 11.3 vs 10.5 with 4), and its
short turns hid the loop's lag from the deferral above (at 256 streams here: 2.2 instead of 16.4 tokens
per client message, 7.5k instead of 17.4k tokens per router CPU-second).

Sinks (`Inbox.sink`): a consumer whose per-item work is plain bookkeeping (the engine stage
handing a chunk of new tokens to the detokenizer) may set a sink; the reader then calls it with
each item while the inbox is empty (so the order is kept) and an item it takes is never buffered:
no task hop for it. Whatever it declines (a first, last or failed item) is buffered and wakes the
consumer as before. A stream's end (`StreamBroken`) always goes through the inbox. While the loop
is behind (the wake-ups are deferred) no sink is called: the items merge in the inbox and the
consumer takes them in one go, as without a sink (with the sink called regardless, every engine
chunk went on alone and the relay at saturation fell from ~17 to ~1.4 tokens per client message).

Merging (`merge`): an item that arrives while the request's previous one still waits in its inbox
may be folded into it (new tokens appended to the pending chunk), so a consumer that lags takes one
item however many messages arrived, and no per-item object is built for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import grpc

from services.errors import REASON_KEY, Reason, TokenrelayError, from_rpc_error
from services.loopidle import cpu_allowance, idle_seconds, spun_idle_seconds

Item = TypeVar("Item")


@dataclass(frozen=True)
class StreamBroken:
    error: TokenrelayError


class Inbox(Generic[Item]):
    """One request's response items: append without a hop, wake the one consumer once per burst.

    Has the part of `asyncio.Queue`'s interface the router uses (`get`, `put_nowait`,
    `get_nowait`, `empty`, `qsize`), plus `get_ready()`: every item ready now, waiting only when
    there is none.
    """

    __slots__ = ("_items", "_waiter", "sink", "wakes")

    def __init__(self) -> None:
        self._items: deque[Item | StreamBroken] = deque()
        self._waiter: asyncio.Future[None] | None = None
        # The consumer's synchronous fast path (module doc): called by the reader with each item
        # while nothing waits in the inbox; True = taken (never buffered, nobody woken).
        self.sink: Callable[[Item], bool] | None = None
        self.wakes = 0

    def put_nowait(self, item: Item | StreamBroken) -> None:
        self._items.append(item)
        self.wake()

    def append(self, item: Item | StreamBroken) -> bool:
        """Buffer an item without waking; True if a consumer waits (the caller wakes it later)."""
        self._items.append(item)
        return self._waiter is not None

    def wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self.wakes += 1
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def _wait(self) -> None:
        while not self._items:
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                if self._waiter is waiter:
                    self._waiter = None

    async def get(self) -> Item | StreamBroken:
        if not self._items:
            await self._wait()
        return self._items.popleft()

    async def get_ready(self) -> list[Item | StreamBroken]:
        """Every item ready now (in order); waits only when none is."""
        items = self._items
        if not items:
            await self._wait()
        if len(items) == 1:         # the common case: one item per wake-up
            return [items.popleft()]
        ready = list(items)
        items.clear()
        return ready

    def last(self) -> Item | StreamBroken | None:
        """The newest item not yet taken (None when empty): the one a merge may extend."""
        return self._items[-1] if self._items else None

    def get_nowait(self) -> Item | StreamBroken:
        if not self._items:
            raise asyncio.QueueEmpty
        return self._items.popleft()

    def empty(self) -> bool:
        return not self._items

    def qsize(self) -> int:
        return len(self._items)


_BUSY_LAG = 0.001      # loop lag (s) above which the reader defers wake-ups (module doc)
_BUSY_WINDOW = 0.05    # the loop's busy share is sampled over windows this long (s) ...
_BUSY_SHARE = 0.9      # ... and at this share or more the loop counts as behind (saturated)
_LOOP_SHARE = 0.5      # without a selector to meter: the loop thread's share of a core that, with the
                       # whole process at _BUSY_SHARE of its CPU allowance, counts as saturated too


class _Waker:
    """Wakes the inboxes that got items, once per flush; flushes at once while the loop keeps up,
    after about its lag (at most `max_delay`) while it does not."""

    def __init__(self, max_delay: float) -> None:
        self._max_delay = max_delay
        self._pending: list[Inbox[Any]] = []
        self._due = 0.0                    # when the scheduled flush should run; 0 = none scheduled
        self._probing = False              # a lag probe is scheduled
        self._window: tuple[float, float, float] | None = None   # (loop time, busy s, process CPU s) at its start
        self._allowance = 0.0              # CPUs the process may use (read once, when first needed)
        self.lag = 0.0                     # smoothed lag of flushes and probes (s)
        self.saturated = False             # the loop was busy >= _BUSY_SHARE of the last window
        self.flushes = 0

    def probe(self, loop: asyncio.AbstractEventLoop) -> None:
        """Measure the loop's lag now (once per loop turn at most): the reader calls it for every
        message, so the lag stays current while sinks take every item and nothing is flushed."""
        if not self._probing:
            self._probing = True
            loop.call_soon(self._probed, loop, loop.time())

    def _probed(self, loop: asyncio.AbstractEventLoop, sent: float) -> None:
        self._probing = False
        now = loop.time()
        self.lag += (now - sent - self.lag) * 0.25
        window = self._window
        if window is None or now - window[0] >= _BUSY_WINDOW:
            idle = idle_seconds(loop)
            spun = spun_idle_seconds()      # a loop kept polling on purpose is idle then, not busy
            # busy seconds so far: time not spent waiting in the selector; else (uvloop) the loop
            # thread's CPU time, read beside the process's (module doc)
            if idle is not None:
                busy, process = now - idle - spun, 0.0
            else:
                busy, process = time.thread_time() - spun, time.process_time() - spun
            if window is not None:
                span = now - window[0]
                self.saturated = busy - window[1] >= _BUSY_SHARE * span
                if idle is None and not self.saturated and busy - window[1] >= _LOOP_SHARE * span:
                    if not self._allowance:
                        self._allowance = cpu_allowance()
                    self.saturated = process - window[2] >= _BUSY_SHARE * self._allowance * span
            self._window = (now, busy, process)

    @property
    def defers(self) -> bool:
        """Wake-ups may be deferred (a `max_delay` above 0)."""
        return self._max_delay > 0

    @property
    def behind(self) -> bool:
        """Lag above `_BUSY_LAG`, or the loop saturated: defer wake-ups, merge, call no sinks."""
        return self.saturated or self.lag > _BUSY_LAG

    def add(self, inbox: Inbox[Any]) -> None:
        self._pending.append(inbox)
        if self._due:
            return
        loop = asyncio.get_running_loop()
        delay = self._max_delay if self.behind else 0.0
        self._due = loop.time() + delay
        if delay:
            loop.call_later(delay, self._flush)
        else:
            loop.call_soon(self._flush)

    def _flush(self) -> None:
        late = asyncio.get_running_loop().time() - self._due
        self.lag += (max(late, 0.0) - self.lag) * 0.25
        self._due = 0.0
        self.flushes += 1
        pending, self._pending = self._pending, []
        for inbox in pending:
            inbox.wake()


class MuxClient(Generic[Item]):
    """One multiplexed stream.

    ``open_call(request_iterator)`` starts the gRPC call (or a `services.frames.FrameCall`);
    ``build(pending)`` turns a dict of field name → list of posted items into one request message;
    ``split(response)`` yields ``(request_id, raw)`` pairs of a response message; ``convert(raw)``
    makes the item (default: the raw value itself) unless ``merge(pending_item, raw)`` folded it
    into the request's pending item and returned True (module doc). ``on_message(response)``, when given, sees
    every response message first (e.g. a load report riding on the stream). ``max_wake_delay``:
    how long a busy loop may defer consumers' wake-ups (module doc; 0 = never deferred).
    """

    def __init__(self, name: str, open_call: Callable[[AsyncIterator[Any]], Any],
                 build: Callable[[dict[str, list[Any]]], Any],
                 split: Callable[[Any], list[tuple[str, Any]]],
                 on_message: Callable[[Any], None] | None = None, max_wake_delay: float = 0.0,
                 convert: Callable[[Any], Item] | None = None,
                 merge: Callable[[Item, Any], bool] | None = None,
                 on_broken: Callable[[TokenrelayError], None] | None = None) -> None:
        self.name = name
        self._open_call = open_call
        self._build = build
        self._split = split
        self._on_message = on_message
        self._on_broken = on_broken      # the stream broke (not closed by us): a transport failure
        self._convert = convert
        self._merge = merge
        self._waker = _Waker(max_wake_delay)
        self._pending: dict[str, list[Any]] = {}
        self._wake = asyncio.Event()
        self._inboxes: dict[str, Inbox[Item]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._closed = False
        self.messages_sent = 0
        self.messages_received = 0
        self.last_received = 0.0   # loop time of the last message received (0: none yet)
        self.items_received = 0

    # -- request side -------------------------------------------------------------------------
    def open(self, request_id: str) -> Inbox[Item]:
        """Register a request; its response items arrive in the returned inbox."""
        if self._closed:
            raise Reason.UPSTREAM_UNAVAILABLE.error(f"{self.name} client is closed")
        if self._reader is None or self._reader.done():
            self._start()
        inbox: Inbox[Item] = Inbox()
        self._inboxes[request_id] = inbox
        return inbox

    def release(self, request_id: str) -> bool:
        """Forget the request's inbox; whether it was still open."""
        return self._inboxes.pop(request_id, None) is not None

    def post(self, field: str, item: Any) -> None:
        """Queue one item for the next outbound message (never blocks)."""
        self._pending.setdefault(field, []).append(item)
        self._wake.set()

    @property
    def open_requests(self) -> int:
        return len(self._inboxes)

    @property
    def loop_lag(self) -> float:
        """Smoothed lag (s) of this stream's wake-ups: how far behind the loop is."""
        return self._waker.lag

    @property
    def connected(self) -> bool:
        return self._reader is not None and not self._reader.done()

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
        inboxes = self._inboxes
        loop = asyncio.get_running_loop()
        try:
            async for response in call:
                self.messages_received += 1
                self.last_received = loop.time()
                self._waker.probe(loop)
                if self._on_message is not None:
                    self._on_message(response)
                items = self._split(response)
                self.items_received += len(items)
                waker, convert, merge = self._waker, self._convert, self._merge
                # While the loop is behind, no sink: items wait in their inboxes for the deferred
                # wake-up and merge, so each consumer takes many at once (a sink would pass every
                # item on one by one). With no deferral (max_wake_delay 0) that merge does not
                # happen, and the sink's saved task hop is all there is to gain: sinks stay on.
                sinks = not (waker.behind and waker.defers)
                for request_id, raw in items:
                    inbox = inboxes.get(request_id)
                    if inbox is None:
                        continue
                    if merge is not None:
                        pending = inbox.last()
                        if pending is not None and not isinstance(pending, StreamBroken) and merge(pending, raw):
                            continue       # folded into the item that already waits (and is woken)
                    item = convert(raw) if convert is not None else raw
                    sink = inbox.sink
                    if sink is not None and sinks and not inbox._items and sink(item):
                        continue           # taken by the consumer's sink: no buffer, no wake-up
                    if inbox.append(item):
                        if inbox.wakes:
                            waker.add(inbox)
                        else:
                            inbox.wake()   # a first item goes at once
        except (grpc.aio.AioRpcError, TokenrelayError) as exc:
            # A TokenrelayError: a stream that is no gRPC call (services/frames.py) failed, typed already.
            error = stream_error(exc, self.name) if isinstance(exc, grpc.aio.AioRpcError) else exc
            if self._on_broken is not None and not self._closed:
                self._on_broken(error)
        except asyncio.CancelledError:
            call.cancel()
            raise
        finally:
            broken = StreamBroken(error)
            for inbox in inboxes.values():
                inbox.put_nowait(broken)
            inboxes.clear()

    async def close(self) -> None:
        self._closed = True
        self._wake.set()
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader


def stream_error(exc: grpc.aio.AioRpcError, what: str) -> TokenrelayError:
    """The typed error of a failed call to an upstream, the one translation for the tokenizer's and
    engines' channels: the peer's own reason when it sent one (OVERLOADED stays OVERLOADED), else
    UPSTREAM_UNAVAILABLE (retryable) for a transport failure: a connection refused or reset, a
    cancelled call, or an INTERNAL/UNKNOWN that gRPC itself raised with no reason from the peer (a
    peer killed mid-call reads "Internal error from Core" or "Stream removed")."""
    code = exc.code()
    if not _peer_reason(exc) and code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED,
                                          grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN):
        error: TokenrelayError = Reason.UPSTREAM_UNAVAILABLE.error(f"{what}: {code.name}: {exc.details()}")
        error.__cause__ = exc
        return error
    return from_rpc_error(exc)


def _peer_reason(exc: grpc.aio.AioRpcError) -> str:
    for key, value in exc.trailing_metadata() or ():
        if key == REASON_KEY:
            return str(value)
    return ""
