"""One multiplexed Stream: many requests in, one coalesced flow of token chunks out.

A `StreamSession` owns a reader task (inbound submits and aborts), the stream's `Outbox` and the
ids of the requests it carries. It is the per-request error boundary of a stream: a request that
is rejected or fails becomes a finished ERROR chunk with its reason, and the stream carries on.
Every request that arrives, accepted or rejected, gets its `RequestTelemetry` (span + metrics)
here, the one place all of them pass.
When the stream ends — the client half-closes (or the engine drains for shutdown, or dies) and
every request has finished, or the call is cancelled or breaks — `close()` aborts every request
still live, freeing its engine slot and KV.

Load reports (`take_load`) carry the engine's load, its health and its latest iteration stats; a
change of health (drain started, engine dead) is due at once, even on a message without tokens.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field

from services.errors import Reason, TokenrelayError
from services.logging import get_logger

from .backends.base import GenerationEvent, GenerationRequest, LoadSnapshot
from .backends.events import HealthState, IterationStats
from .engine import Engine
from .outbox import Chunk, Outbox
from .telemetry import RequestTelemetry

log = get_logger(__name__)


@dataclass(slots=True)
class Inbound:
    """One inbound message: requests to start and request ids to abort."""

    submit: list[GenerationRequest] = field(default_factory=list)
    abort: list[str] = field(default_factory=list)


# Seconds between load reports piggybacked on a busy stream (a report goes only when the load
# changed; the first message and a change of health always carry one).
LOAD_REPORT_INTERVAL = 0.05

# Seconds a stream that holds requests may go without a message: a request queued behind the batch
# (the KV cache full) sends nothing until it runs, and a router takes a silent stream for a stalled
# engine after its progress timeout (10 s by default). An empty message says the engine is alive.
KEEPALIVE_INTERVAL = 1.0

# (load, draining, health, stats): ``draining`` is True whenever the engine takes no new work
# (draining or dead), which is what routers that predate ``health`` read.
LoadReport = tuple[LoadSnapshot, bool, HealthState, IterationStats]


class StreamSession:
    def __init__(self, engine: Engine, load_interval: float = LOAD_REPORT_INTERVAL,
                 keepalive: float = KEEPALIVE_INTERVAL) -> None:
        self._engine = engine
        self._keepalive = keepalive
        self._sent_at = time.monotonic()
        self._ticker: asyncio.TimerHandle | None = None
        self._load_interval = load_interval
        self._load_at = -1e18
        self._load_last: LoadReport | None = None
        self.outbox = Outbox()
        self._live: set[str] = set()
        self._reader: asyncio.Task[None] | None = None
        self._inbound_done = False
        self._closed = False

    @property
    def live(self) -> int:
        return len(self._live)

    def take_load(self) -> LoadReport | None:
        """The engine's report if one is due on the next message, else None: at most every
        `load_interval` and only when it changed; a change of health is due at once."""
        health = self._engine.health
        now = time.monotonic()
        if not self._health_unreported(health) and now - self._load_at < self._load_interval:
            return None
        engine = self._engine
        report = (engine.load(), health is not HealthState.SERVING, health, engine.iteration_stats())
        self._load_at = now
        if report == self._load_last:
            return None
        self._load_last = report
        return report

    def _health_unreported(self, health: HealthState | None = None) -> bool:
        health = self._engine.health if health is None else health
        last = self._load_last
        # The first report goes with the first message anyway; what must not wait is a change.
        return (last is not None and last[2] is not health) or (last is None and health is not HealthState.SERVING)

    def submit(self, request: GenerationRequest) -> None:
        rid = request.request_id
        telemetry = RequestTelemetry(request, self._on_event)
        if rid in self._live:
            self._reject(telemetry, rid, Reason.DUPLICATE_REQUEST_ID,
                         f"request id {rid!r} is already live on this stream")
            return
        self._live.add(rid)
        try:
            self._engine.submit(request, telemetry)
        except TokenrelayError as exc:
            self._live.discard(rid)
            self._reject(telemetry, rid, exc.reason, exc.message)
        except Exception as exc:  # a backend bug must not take the other requests down
            self._live.discard(rid)
            log.exception("submit_failed", request_id=rid)
            self._reject(telemetry, rid, Reason.ENGINE_ERROR, f"engine failed to accept the request: {exc!r}")

    def _reject(self, telemetry: RequestTelemetry, request_id: str, reason: str, message: str) -> None:
        telemetry.rejected(reason, message)
        # A separate chunk, so a rejected duplicate never merges into the live request's chunk.
        self.outbox.push_separate(GenerationEvent.failed(request_id, reason, message))

    def _on_event(self, event: GenerationEvent) -> None:
        if event.finished:
            self._live.discard(event.request_id)
        self.outbox.push(event)

    def abort(self, request_ids: list[str]) -> None:
        self._engine.abort([rid for rid in request_ids if rid in self._live])

    async def _read(self, inbound: AsyncIterator[Inbound]) -> None:
        try:
            async for message in inbound:
                for request in message.submit:
                    self.submit(request)
                if message.abort:
                    self.abort(message.abort)
        finally:
            self._inbound_done = True
            self.outbox.wake()

    async def run(self, inbound: AsyncIterator[Inbound]) -> AsyncGenerator[list[Chunk], None]:
        """Serve the stream: yields batches of chunks until the inbound side is done and every
        request it carried has finished."""
        self._reader = asyncio.create_task(self._read(inbound), name="engine-stream-reader")
        self._reader.add_done_callback(_note_reader_end)
        unregister = self._engine.on_health_change(self.outbox.wake)
        self._ticker = asyncio.get_running_loop().call_later(self._keepalive, self._tick)
        try:
            while True:
                await self.outbox.wait()
                chunks = self.outbox.drain()
                # a drain or a death is told even with no tokens, and a keepalive with none
                if chunks or self._health_unreported() or self._keepalive_due():
                    self._sent_at = time.monotonic()
                    yield chunks
                if ((self._inbound_done or self._engine.health is not HealthState.SERVING) and not self._live
                        and self.outbox.empty):
                    break
        finally:
            if self._ticker is not None:
                self._ticker.cancel()
            unregister()
            self.close()

    def _keepalive_due(self) -> bool:
        """The stream holds requests and sent nothing for `keepalive` seconds (KEEPALIVE_INTERVAL)."""
        return bool(self._live) and time.monotonic() - self._sent_at >= self._keepalive

    def _tick(self) -> None:
        """Once per `keepalive`: wake the writer when a keepalive is due."""
        if self._closed:
            return
        if self._keepalive_due():
            self.outbox.wake()
        self._ticker = asyncio.get_running_loop().call_later(self._keepalive, self._tick)

    def close(self) -> None:
        """Abort what is still live (idempotent; also called when the RPC ends)."""
        if self._closed:
            return
        self._closed = True
        if self._reader is not None and not self._reader.done():
            self._reader.cancel()
        if self._live:
            log.info("stream_closed_aborting", requests=len(self._live))
            self._engine.abort(list(self._live))


def _note_reader_end(task: asyncio.Task[None]) -> None:
    # Retrieving the exception here keeps asyncio from reporting it as never retrieved.
    if not task.cancelled() and task.exception() is not None:
        log.info("stream_inbound_broke", error=repr(task.exception()))
