"""The engine facade: one backend, the registry of live requests across every stream, admission.

It is the one place that decides whether a request may enter the backend: shared validation,
duplicate live ids (DUPLICATE_REQUEST_ID) and the bound on requests in flight — the backend's
batch plus ``max_queued`` waiting — beyond which submits are rejected with OVERLOADED
instead of queueing without limit. It also lets a unary Abort reach a request of any stream, and
drains for a graceful shutdown: after `drain()` new submits are refused (SHUTTING_DOWN, which the
registry marks retryable, so routers retry elsewhere) and every stream ends by itself once it
carries no live request.
Between `start()` and `close()` its backend is attached to the metrics collector.
"""

from __future__ import annotations

from collections.abc import Callable

from services.errors import Reason
from services.logging import get_logger

from . import metrics
from .backends.base import Backend, GenerationEvent, GenerationRequest, LoadSnapshot, Sink

log = get_logger(__name__)


class Engine:
    def __init__(self, backend: Backend, max_queued: int) -> None:
        self.backend = backend
        self.max_queued = max_queued
        self._live: set[str] = set()
        self._capacity = 0
        self.draining = False
        self._drain_listeners: set[Callable[[], None]] = set()

    async def start(self) -> None:
        await self.backend.start()
        self._capacity = self.backend.load().max_active + self.max_queued
        metrics.attach(self.backend)

    async def close(self) -> None:
        metrics.detach(self.backend)
        await self.backend.close()

    def drain(self) -> None:
        """Refuse new requests from now on; streams end once their requests have finished."""
        self.draining = True
        for wake in list(self._drain_listeners):
            wake()

    def on_drain(self, wake: Callable[[], None]) -> Callable[[], None]:
        """Register a callback run by `drain()`; returns the function that unregisters it."""
        self._drain_listeners.add(wake)
        return lambda: self._drain_listeners.discard(wake)

    @property
    def live(self) -> int:
        return len(self._live)

    def submit(self, request: GenerationRequest, sink: Sink) -> None:
        """Admit a request or raise the typed reason it cannot run."""
        rid = request.request_id
        if rid in self._live:
            raise Reason.DUPLICATE_REQUEST_ID.error(f"request id {rid!r} is already live")
        self.backend.validate(request)
        if self.draining:
            raise Reason.SHUTTING_DOWN.error("engine is shutting down")
        if len(self._live) >= self._capacity:
            raise Reason.OVERLOADED.error(f"engine queue is full ({len(self._live)} requests in flight)")
        live = self._live

        def on_event(event: GenerationEvent) -> None:
            if event.finished:
                live.discard(rid)
            sink(event)

        live.add(rid)
        try:
            self.backend.submit(request, on_event)
        except BaseException:
            live.discard(rid)
            raise

    def abort(self, request_ids: list[str]) -> int:
        """Abort live requests by id, whichever stream carries them; returns how many were live."""
        return sum(1 for rid in request_ids if rid in self._live and self.backend.abort(rid))

    def load(self) -> LoadSnapshot:
        return self.backend.load()
