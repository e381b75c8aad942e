"""The engine stage: one owner of a request's attempts on engine replicas.

`EngineStage.run(state, detok, ...)` places the request (a `Placement` policy over the replicas'
snapshots: an unhealthy, draining or not-serving replica gets no new work; the session's replica
is preferred), submits it, and feeds the engine's tokens to the detokenizer. Before the first
token, a failure the registry marks retryable (stream broken, in-band OVERLOADED, SHUTTING_DOWN,
ENGINE_UNAVAILABLE) or silence for `progress_timeout` seconds is retried on another replica, up
to `attempts` replicas in all, and never reaches the client. After the first token a failure ends
the request (a stall beyond `progress_timeout` as ENGINE_STALLED, retryable by the client).
The stage's result reaches the delta loop through the detokenizer: tokens, or `detok.fail(error)`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.context import Context

from services.errors import Reason, TokenrelayError, in_band_error
from services.logging import get_logger
from services.tracing import inject, tracer

from .ports import ChunkSource, DetokSessionPort, EngineStream, Placement, PlacementView, SessionAffinity
from .request import RequestState
from .types import EngineChunk

log = get_logger(__name__)
_tracer = tracer("tokenrelay.router")


# In-band refusals that mean the replica takes no new work (draining, backend stopped); an
# OVERLOADED replica is healthy, only busy, and stays eligible for other requests.
_REPLICA_DOWN = frozenset({Reason.SHUTTING_DOWN, Reason.ENGINE_UNAVAILABLE})


class _Retry(Exception):
    """This attempt failed in a way another replica may cure."""

    def __init__(self, error: TokenrelayError, broken: bool) -> None:
        super().__init__(str(error))
        self.error = error
        self.broken = broken    # the replica itself looks broken (not merely busy)


@dataclass
class EngineStage:
    engines: EngineStream
    placement: Placement
    affinity: SessionAffinity
    attempts: int = 2
    progress_timeout: float = 10.0

    async def run(self, state: RequestState, detok: DetokSessionPort, eos: list[int],
                  trace_ctx: Context | None = None) -> None:
        """Engine → detokenizer until the engine finishes; any failure goes to `detok.fail`."""
        try:
            await self._attempts(state, detok, eos, trace_ctx)
        except TokenrelayError as exc:
            detok.fail(exc)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - surfaced to the request, never swallowed
            detok.fail(Reason.ENGINE_ERROR.error(f"engine stage failed: {exc!r}"))

    async def _attempts(self, state: RequestState, detok: DetokSessionPort, eos: list[int],
                        trace_ctx: Context | None) -> None:
        view = await self._view(state)
        while True:
            address = self._place(state, view, trace_ctx)
            try:
                await self._attempt(state, address, detok, eos, trace_ctx)
                if state.inp.session_id and address != view.sticky:
                    await self.affinity.set(state.tenant, state.inp.session_id, address)
                return
            except _Retry as retry:
                self.engines.release(address, state.upstream_id)
                if state.first_token_seen or len(state.attempts) >= self.attempts or state.is_cancelled:
                    raise retry.error from None
                if retry.broken:
                    self.engines.mark_failed(address)
                state.last_error = retry.error
                log.warning("engine_retry", request_id=state.request_id, failed=address,
                            reason=retry.error.reason)

    async def _view(self, state: RequestState) -> PlacementView:
        session = state.inp.session_id
        sticky = await self.affinity.get(state.tenant, session) if session else ""
        return PlacementView(state.tenant, session, len(state.prompt_ids), sticky)

    def _place(self, state: RequestState, view: PlacementView, trace_ctx: Context | None) -> str:
        with _tracer.start_as_current_span("route", context=trace_ctx) as span:
            try:
                address = self.placement.choose(self.engines.snapshots(), view, frozenset(state.attempts))
            except TokenrelayError:
                if state.last_error is not None:  # nowhere left: the client hears why the last one failed
                    raise state.last_error from None
                raise
            span.set_attribute("tokenrelay.replica", address)
        state.replica = address
        state.attempts.append(address)
        return address

    async def _attempt(self, state: RequestState, address: str, detok: DetokSessionPort, eos: list[int],
                       trace_ctx: Context | None) -> None:
        phase = _tracer.start_span("prefill", context=trace_ctx)
        prefilling = True
        watchdog = _Watchdog(self.progress_timeout)
        try:
            source = self.engines.submit(address, state.upstream_id, state.prompt_ids, state.inp.sampling, eos,
                                         state.tenant, inject(trace.set_span_in_context(phase)),
                                         timeout=state.remaining(), priority=state.priority)
            while True:
                chunk = await self._next(state, source, address, watchdog)
                if prefilling and chunk.token_ids:
                    phase.end()
                    phase, prefilling = _tracer.start_span("decode", context=trace_ctx), False
                if chunk.error_reason:
                    self._engine_error(state, chunk)
                if chunk.cached_tokens:
                    state.usage.cached_tokens = chunk.cached_tokens
                state.generated.extend(chunk.token_ids)
                if chunk.finished:
                    state.engine_done = True
                    state.finish_reason = chunk.finish_reason or "length"
                detok.send(chunk.token_ids, final=chunk.finished)
                if chunk.finished:
                    return
        finally:
            watchdog.close()
            phase.end()

    async def _next(self, state: RequestState, source: ChunkSource, address: str,
                    watchdog: _Watchdog) -> EngineChunk:
        try:
            item = await source.get()
            watchdog.last = watchdog.loop.time()
        except asyncio.CancelledError:
            if not watchdog.take_fired():
                raise
            self.engines.abort(address, state.upstream_id)
            if state.first_token_seen:
                state.engine_done = True   # aborted: nothing left to abort
                raise Reason.ENGINE_STALLED.error(
                    f"engine {address} sent nothing for {self.progress_timeout:g} s") from None
            raise _Retry(Reason.ENGINE_STALLED.error(
                f"engine {address} sent nothing for {self.progress_timeout:g} s before the first token"),
                broken=True) from None
        if not isinstance(item, EngineChunk):   # the stream broke
            error = item.error
            if not isinstance(error, TokenrelayError):
                error = Reason.UPSTREAM_UNAVAILABLE.error(f"engine stream broke: {error!r}")
            raise _Retry(error, broken=True)
        return item

    def _engine_error(self, state: RequestState, chunk: EngineChunk) -> None:
        error = in_band_error(chunk.error_reason, chunk.error_message, Reason.ENGINE_ERROR)
        if error.retryable and not state.first_token_seen:
            # The engine ended this attempt (e.g. OVERLOADED, draining): healthy, just refusing.
            raise _Retry(error, broken=error.reason in _REPLICA_DOWN)
        state.engine_done = True
        raise error


class _Watchdog:
    """The progress timeout of one attempt at no cost per chunk: the reader stamps `last`; a
    timer that wakes once per `timeout` cancels the reading task when nothing came for that
    long (an `asyncio.timeout` per chunk cost ~14% of the core's CPU)."""

    def __init__(self, timeout: float) -> None:
        self.loop = asyncio.get_running_loop()
        self.timeout = timeout
        self.last = self.loop.time()
        self.task = asyncio.current_task()
        self.fired = False
        self._handle = self.loop.call_at(self.last + timeout, self._check)

    def _check(self) -> None:
        due = self.last + self.timeout
        if self.loop.time() >= due:
            self.fired = True
            if self.task is not None:
                self.task.cancel()
        else:
            self._handle = self.loop.call_at(due, self._check)

    def take_fired(self) -> bool:
        """True (once) if this watchdog caused the cancellation being handled."""
        if not self.fired:
            return False
        self.fired = False
        if self.task is not None and self.task.uncancel() > 0:
            return False   # someone else cancelled the task too: that cancellation wins
        return True

    def close(self) -> None:
        self._handle.cancel()
