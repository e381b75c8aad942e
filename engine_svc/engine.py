"""The engine facade: one backend, the registry of live requests across every stream, admission,
deadlines and health.

It is the one place that decides whether a request may enter the backend: shared validation,
duplicate live ids (DUPLICATE_REQUEST_ID) and the bound on requests in flight — the backend's
batch plus ``max_queued`` waiting — beyond which submits are rejected with OVERLOADED
instead of queueing without limit. It also lets a unary Abort reach a request of any stream, and
drains for a graceful shutdown: after `drain()` new submits are refused (SHUTTING_DOWN, which the
registry marks retryable, so routers retry elsewhere) and every stream ends by itself once it
carries no live request.

Health (issue 13): SERVING, DRAINING (after `drain()` or when the backend drains) or DEAD (the
backend reported its engine dead). On DEAD every request still live here ends at once with ERROR /
ENGINE_UNAVAILABLE (retryable: the router resubmits it elsewhere before its first token), whatever
the backend managed to send, new submits are refused with the same reason, and the listeners
(streams, the gRPC health service) hear of it; nothing waits on a dead engine. A request's
``deadline`` is enforced here for every backend: one timer per request that has one, which aborts
it and ends it with DEADLINE_EXCEEDED.
Between `start()` and `close()` its backend is attached to the metrics collector.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from services.errors import Reason
from services.logging import get_logger

from . import metrics
from .backends.base import Backend, FinishReason, GenerationEvent, GenerationRequest, LoadSnapshot, Sink
from .backends.events import HealthState, IterationStats, KvEventSubscription

log = get_logger(__name__)


class _Live:
    """One admitted request: its sink and, when it has a deadline, the timer that ends it."""

    __slots__ = ("expired", "sink", "timer")

    def __init__(self, sink: Sink) -> None:
        self.sink = sink
        self.timer: asyncio.TimerHandle | None = None
        self.expired = False


class Engine:
    def __init__(self, backend: Backend, max_queued: int) -> None:
        self.backend = backend
        self.max_queued = max_queued
        self._live: dict[str, _Live] = {}
        self._capacity = 0
        self.draining = False
        self._listeners: set[Callable[[], None]] = set()

    async def start(self) -> None:
        self.backend.health_listener = self._on_backend_health
        await self.backend.start()
        self._capacity = self.backend.load().max_active + self.max_queued
        metrics.attach(self.backend)

    async def close(self) -> None:
        metrics.detach(self.backend)
        await self.backend.close()
        self.backend.close_kv_events()   # subscriptions end even where a backend's close() forgets them
        self.backend.health_listener = None
        for live in self._live.values():
            if live.timer is not None:
                live.timer.cancel()

    # -- health -------------------------------------------------------------------------------
    @property
    def health(self) -> HealthState:
        state = self.backend.health()
        if state is HealthState.SERVING and self.draining:
            return HealthState.DRAINING
        return state

    def drain(self) -> None:
        """Refuse new requests from now on; streams end once their requests have finished."""
        self.draining = True
        # KV-event subscriptions end now: an open one would otherwise hold the server (and its
        # shutdown grace) until it expires; a draining engine's cache is no reason to route to it.
        self.backend.close_kv_events()
        self._notify()

    def on_health_change(self, wake: Callable[[], None]) -> Callable[[], None]:
        """Register a callback run when the health changes (drain, backend dead); returns the
        function that unregisters it."""
        self._listeners.add(wake)
        return lambda: self._listeners.discard(wake)

    on_drain = on_health_change

    def _notify(self) -> None:
        for wake in list(self._listeners):
            wake()

    def _on_backend_health(self, state: HealthState) -> None:
        if state in (HealthState.DEAD, HealthState.UNAVAILABLE):
            detail = self.backend.health_detail or "the engine backend failed"
            dead = state is HealthState.DEAD
            (log.error if dead else log.warning)("engine_dead" if dead else "engine_unavailable",
                                                 backend=self.backend.name, detail=detail, live=len(self._live))
            what = "engine died" if dead else "engine unavailable"
            for rid in list(self._live):
                self._finish(rid, GenerationEvent.failed(rid, Reason.ENGINE_UNAVAILABLE, f"{what}: {detail}"))
        else:
            log.info("engine_health", backend=self.backend.name, state=state.value)
        self._notify()

    # -- requests -----------------------------------------------------------------------------
    @property
    def live(self) -> int:
        return len(self._live)

    def submit(self, request: GenerationRequest, sink: Sink) -> None:
        """Admit a request or raise the typed reason it cannot run."""
        rid = request.request_id
        if rid in self._live:
            raise Reason.DUPLICATE_REQUEST_ID.error(f"request id {rid!r} is already live")
        self.backend.validate(request)
        health = self.health
        if health is HealthState.DEAD:
            raise Reason.ENGINE_UNAVAILABLE.error(f"engine is dead: {self.backend.health_detail}")
        if health is HealthState.UNAVAILABLE:
            raise Reason.ENGINE_UNAVAILABLE.error(f"engine is unavailable: {self.backend.health_detail}")
        if health is HealthState.DRAINING:
            raise Reason.SHUTTING_DOWN.error("engine is shutting down")
        if request.deadline is not None and request.deadline <= time.monotonic():
            raise Reason.DEADLINE_EXCEEDED.error("the request's deadline passed before it reached the engine")
        if len(self._live) >= self._capacity:
            raise Reason.OVERLOADED.error(f"engine queue is full ({len(self._live)} requests in flight)")
        entry = self._live[rid] = _Live(sink)
        registry = self._live

        def on_event(event: GenerationEvent) -> None:
            if registry.get(rid) is not entry:
                return   # already ended here (engine died, deadline): the backend's late events
            if event.finished:
                del registry[rid]
                if entry.timer is not None:
                    entry.timer.cancel()
                if entry.expired and event.finish_reason is FinishReason.CANCELLED:
                    event = GenerationEvent.failed(rid, Reason.DEADLINE_EXCEEDED, "the request's deadline passed",
                                                   event.token_ids)
            sink(event)

        try:
            self.backend.submit(request, on_event)
        except BaseException:
            if registry.get(rid) is entry:
                del registry[rid]
            raise
        if request.deadline is not None and rid in registry:
            loop = asyncio.get_running_loop()
            delay = request.deadline - time.monotonic()
            entry.timer = loop.call_at(loop.time() + max(0.0, delay), self._expire, rid, entry)

    def _expire(self, rid: str, entry: _Live) -> None:
        if self._live.get(rid) is not entry:
            return
        entry.expired = True
        entry.timer = None
        if not self.backend.abort(rid):   # the backend lost it: end it here
            self._finish(rid, GenerationEvent.failed(rid, Reason.DEADLINE_EXCEEDED, "the request's deadline passed"))

    def _finish(self, rid: str, event: GenerationEvent) -> None:
        entry = self._live.pop(rid, None)
        if entry is None:
            return
        if entry.timer is not None:
            entry.timer.cancel()
        entry.sink(event)

    def abort(self, request_ids: list[str]) -> int:
        """Abort live requests by id, whichever stream carries them; returns how many were live."""
        return sum(1 for rid in request_ids if rid in self._live and self.backend.abort(rid))

    # -- what the engine reports --------------------------------------------------------------
    def load(self) -> LoadSnapshot:
        return self.backend.load()

    def iteration_stats(self) -> IterationStats:
        return self.backend.iteration_stats()

    def subscribe_kv_events(self) -> KvEventSubscription:
        return self.backend.kv_events()
