"""The engine stage: one owner of a request's attempts on engine replicas.

`EngineStage.start(state, detok, ...)` places the request (a `Placement` policy over the replicas'
snapshots: an unhealthy, draining or not-serving replica gets no new work; the session's replica
is preferred) and submits it, in its caller's step when nothing is left to wait for, then runs
`run` as a task that feeds the engine's tokens to the detokenizer. Before the first
token, a failure the registry marks retryable (stream broken, in-band OVERLOADED, SHUTTING_DOWN,
ENGINE_UNAVAILABLE) or silence for `progress_timeout` seconds is retried on another replica, up
to `attempts` replicas in all, and never reaches the client. After the first token a failure ends
the request (a stall beyond `progress_timeout` as ENGINE_STALLED, retryable by the client).
The stage's result reaches the delta loop through the detokenizer: tokens, or `detok.fail(error)`.

After the first token, a replica that breaks or stalls is recovered by migration (up to
`migrations` times): the prompt plus every token generated so far is submitted to another
replica with the remaining token budget, and the detokenizer keeps receiving tokens as if
nothing happened; `state.migrations` tells the delta loop to send the client a `Migrated` event.
Greedy output is identical to an uninterrupted run; a sampled request continues as a valid sample
(not the one the first replica would have drawn; a seed no longer reproduces it).

Pools and placement: `pools` (a `PoolSelector`) picks the request's engine pool before its first
placement; the policy sees only that pool's replicas. The prefix index (when the policy keeps
one) learns each placement. A session whose replica is gone, unavailable or saturated moves; the
move is counted (`tokenrelay_router_session_moves_total`) and logged. `shadow` (a `Shadow`) hears
when the primary is placed and when it ends.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span

from services.errors import Reason, TokenrelayError, in_band_error
from services.logging import get_logger
from services.tracing import child_span, inject, start_span, tracer

from .metrics_routing import MIGRATIONS, ROUTE_SECONDS, ROUTED, SESSION_MOVES
from .ports import (
    ChunkSource,
    DetokSessionPort,
    EngineStream,
    Placement,
    PlacementView,
    PoolSelector,
    ReplicaSnapshot,
    SessionAffinity,
    Shadow,
)
from .prefix_index import PrefixIndex
from .request import RequestState
from .types import EngineChunk

log = get_logger(__name__)
_tracer = tracer("tokenrelay.router")


# In-band refusals that mean the replica takes no new work (draining, backend stopped); an
# OVERLOADED replica is healthy, only busy, and stays eligible for other requests.
_REPLICA_DOWN = frozenset({Reason.SHUTTING_DOWN, Reason.ENGINE_UNAVAILABLE})


@dataclass
class _First:
    """A request's first attempt as `EngineStage.start` made it: placed and submitted."""
    view: PlacementView
    address: str
    submitted: tuple[Span, ChunkSource]


@dataclass(frozen=True, slots=True)
class Started:
    """`EngineStage.start`'s result: the stage's task, and whether the first submit was made in the
    caller's step (then the engine stream's sender writes it on the loop's next turn)."""
    task: asyncio.Task[None]
    submitted: bool


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
    migrations: int = 2
    pools: PoolSelector | None = None
    shadow: Shadow | None = None

    def __post_init__(self) -> None:
        index = getattr(self.placement, "index", None)
        self.index: PrefixIndex | None = index if isinstance(index, PrefixIndex) else None
        self.policy_name: str = getattr(self.placement, "name", type(self.placement).__name__)
        # Looked up once (`labels()` locks and checks its arguments on each call).
        self._routed = {hit: ROUTED.labels(self.policy_name, "hit" if hit else "miss") for hit in (True, False)}
        self._route_seconds = ROUTE_SECONDS.labels(self.policy_name)

    def start(self, state: RequestState, detok: DetokSessionPort, eos: list[int],
              trace_ctx: Context | None = None) -> Started:
        """`run` as a task, its first placement and submit made now, in the caller's step, when
        nothing is left to wait for (no session, or its replica's lookup answered): the engine has
        the request before the loop turns and before the caller's own work after this (the
        detokenizer session's start; the request's first tokens cannot come back before the loop
        turns). A placement or submit that fails here fails in the task, as one made there does."""
        first: _First | Exception | None = None
        sticky = state.sticky
        if not state.inp.session_id or (sticky is not None and sticky.done() and not sticky.cancelled()):
            try:
                view = self._view_now(state, sticky.result() if sticky is not None and state.inp.session_id else "")
                address = self._place(state, view, trace_ctx)
                first = _First(view, address, self._submit(state, address, eos, trace_ctx))
            except Exception as exc:  # noqa: BLE001 - raised in the task, as if made there
                first = exc
        task = asyncio.create_task(self.run(state, detok, eos, trace_ctx, first))
        if self.shadow is not None:
            # However the task ends, cancelled before its first step included (`run` never ran then).
            task.add_done_callback(functools.partial(self._primary_ended, state))
        return Started(task, isinstance(first, _First))

    def _primary_ended(self, state: RequestState, _task: asyncio.Task[None]) -> None:
        if self.shadow is not None and state.attempts:
            self.shadow.finished(state)

    async def run(self, state: RequestState, detok: DetokSessionPort, eos: list[int],
                  trace_ctx: Context | None = None, first: _First | Exception | None = None) -> None:
        """Engine → detokenizer until the engine finishes; any failure goes to `detok.fail`.
        `first`: the first attempt as `start` made it (or its failure)."""
        try:
            await self._attempts(state, detok, eos, trace_ctx, first)
        except TokenrelayError as exc:
            state.error = exc
            detok.fail(exc)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - surfaced to the request, never swallowed
            state.error = Reason.ENGINE_ERROR.error(f"engine stage failed: {exc!r}")
            detok.fail(state.error)

    async def _attempts(self, state: RequestState, detok: DetokSessionPort, eos: list[int],
                        trace_ctx: Context | None, first: _First | Exception | None) -> None:
        if isinstance(first, Exception):
            raise first
        view = first.view if first is not None else await self._view(state)
        while True:
            submitted = None
            if first is not None:
                address, submitted, first = first.address, first.submitted, None
            else:
                address = self._place(state, view, trace_ctx)
            try:
                await self._attempt(state, address, detok, eos, trace_ctx, submitted)
                # The engine is done with it: the replica's count falls now, not once the client's
                # `done` is written (the request's end releases again: a no-op). A conversation's next
                # turn, here or at another router (placement_share), follows within milliseconds.
                self.engines.release(address, state.upstream_id)
                if self.index is not None and not state.migrations:   # its next turn is due here
                    self.index.hold(address, state.prompt_ids, view.cache_salt)
                if state.inp.session_id and address != view.sticky:
                    await self.affinity.set(state.tenant, state.inp.session_id, address)
                return
            except _Retry as retry:
                self.engines.release(address, state.upstream_id)
                if retry.broken:
                    self.engines.mark_failed(address)
                if state.is_cancelled:
                    raise retry.error from None
                if state.first_token_seen:
                    self._migrate(state, address, retry.error)
                elif len(state.attempts) >= self.attempts:
                    raise retry.error from None
                state.last_error = retry.error
                log.warning("engine_retry", request_id=state.request_id, failed=address,
                            reason=retry.error.reason, tokens_so_far=len(state.generated))

    def _migrate(self, state: RequestState, address: str, error: TokenrelayError) -> None:
        """After the first token: move on with what was generated, or give up with `error`."""
        left = state.inp.sampling.max_tokens - len(state.generated)
        if state.migrations >= self.migrations or left <= 0 or state.remaining() <= 0:
            raise error
        state.migrations += 1
        state.migration_reason = error.reason
        state.migration_tokens = len(state.generated)
        MIGRATIONS.labels(error.reason).inc()
        log.warning("request_migrating", request_id=state.request_id, failed=address, reason=error.reason,
                    tokens_so_far=len(state.generated), migrations=state.migrations)

    async def _view(self, state: RequestState) -> PlacementView:
        session = state.inp.session_id
        if not session:
            sticky = ""
        elif state.sticky is not None:    # asked for when the request arrived (pipeline.py)
            sticky = await state.sticky
        else:
            sticky = await self.affinity.get(state.tenant, session)
        return self._view_now(state, sticky)

    def _view_now(self, state: RequestState, sticky: str) -> PlacementView:
        session = state.inp.session_id
        if self.pools is not None and not state.pool:
            state.pool = self.pools.choose(state.tenant, session, state.request_id)
        return PlacementView(state.tenant, session, len(state.prompt_ids), sticky, state.pool,
                             state.prompt_ids, state.tenant, state.inp.sampling.max_tokens)

    def _place(self, state: RequestState, view: PlacementView, trace_ctx: Context | None) -> str:
        with child_span(_tracer, "route", context=trace_ctx) as span:
            t0 = time.perf_counter()
            snapshots = self.engines.snapshots()
            if state.generated:     # a migration: the new replica prefills prompt + generated
                prompt, sampling = state.continuation()
                view = replace(view, prompt_ids=prompt, sticky="", prompt_tokens=len(prompt),
                               max_tokens=sampling.max_tokens)
            try:
                address = self.placement.choose(snapshots, view, frozenset(state.attempts))
            except TokenrelayError:
                if state.last_error is not None:  # nowhere left: the client hears why the last one failed
                    raise state.last_error from None
                raise
            if self.index is not None:
                hit = self.index.placed(address, view.prompt_ids, view.cache_salt)
                self._routed[bool(hit)].inc()
            self._route_seconds.observe(time.perf_counter() - t0)
            span.set_attribute("tokenrelay.replica", address)
        if view.sticky and address != view.sticky:
            _session_moved(state, view.sticky, snapshots)
        first = not state.attempts
        state.replica = address
        state.attempts.append(address)
        if first and self.shadow is not None:
            self.shadow.started(state)
        return address

    def _submit(self, state: RequestState, address: str, eos: list[int],
                trace_ctx: Context | None) -> tuple[Span, ChunkSource]:
        """The attempt's submit to `address`: its prefill span and the engine's chunks."""
        phase = start_span(_tracer, "prefill", context=trace_ctx)
        prompt, sampling = state.continuation()   # migrated: from everything already streamed
        state.engine_done = False     # a new attempt: its work is there to abort until it ends
        try:
            return phase, self.engines.submit(address, state.upstream_id, prompt, sampling, eos,
                                              state.tenant, inject(trace.set_span_in_context(phase)),
                                              timeout=state.remaining(), priority=state.priority)
        except BaseException:
            phase.end()
            raise

    async def _attempt(self, state: RequestState, address: str, detok: DetokSessionPort, eos: list[int],
                       trace_ctx: Context | None, submitted: tuple[Span, ChunkSource] | None = None) -> None:
        """One attempt on `address`, submitted here or already (`submitted`, by `start`)."""
        phase, source = submitted if submitted is not None else self._submit(state, address, eos, trace_ctx)
        prefilling = True
        watchdog = _Watchdog(self.progress_timeout, lambda: self.engines.heard(address))
        sinkable = False
        try:
            generated, send, loop = state.generated, detok.send, watchdog.loop

            def started(chunk: EngineChunk) -> None:
                # A chunk's bookkeeping before its tokens, on either path: its first token ends the
                # prefill; the prefix-cache hits of a chunk that did not fail are the request's (not a
                # migration's re-prefill; a failed attempt's are not kept for the next one).
                nonlocal phase, prefilling
                if prefilling and chunk.token_ids:
                    phase.end()
                    phase, prefilling = start_span(_tracer, "decode", context=trace_ctx), False
                if chunk.cached_tokens and not state.migrations and not chunk.error_reason:
                    state.usage.cached_tokens = chunk.cached_tokens

            def direct(chunk: EngineChunk) -> bool:
                # Plain new tokens, the first included: handed on by the mux reader itself (no hop to
                # this task; the first token's path to the client is one wake-up shorter). An error or
                # the last chunk goes through the loop below.
                if state.engine_done or chunk.finished or chunk.error_reason or (prefilling and not chunk.token_ids):
                    return False
                started(chunk)
                watchdog.last = loop.time()
                generated.extend(chunk.token_ids)
                send(chunk.token_ids, False)
                return True
            sinkable = hasattr(source, "sink")
            if sinkable:
                source.sink = direct  # type: ignore[attr-defined]
            while True:
                chunk = await self._next(state, source, address, watchdog)
                started(chunk)
                if chunk.error_reason:
                    self._engine_error(state, chunk)
                state.generated.extend(chunk.token_ids)
                if chunk.finished:
                    state.engine_done = True
                    state.finish_reason = chunk.finish_reason or "length"
                    if self.index is not None:   # what the replica now caches (history-fed replicas)
                        self.index.finished(address, state.prompt_ids, state.generated, state.tenant)
                detok.send(chunk.token_ids, final=chunk.finished)
                if chunk.finished:
                    return
        finally:
            if sinkable:
                source.sink = None  # type: ignore[attr-defined]
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
                state.engine_done = True   # aborted: nothing left to abort (a migration starts afresh)
                raise _Retry(Reason.ENGINE_STALLED.error(
                    f"engine {address} sent nothing for {self.progress_timeout:g} s"), broken=True) from None
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
        down = error.reason in _REPLICA_DOWN
        if error.retryable and (down or not state.first_token_seen):
            # The engine ended this attempt (e.g. OVERLOADED, draining): healthy, just refusing; or
            # its backend stopped mid-stream (migrated, like a broken stream).
            raise _Retry(error, broken=down)
        state.engine_done = True
        raise error


def _session_moved(state: RequestState, held: str, snapshots: Sequence[ReplicaSnapshot]) -> None:
    snap = next((s for s in snapshots if s.address == held), None)
    if snap is None:
        why = "gone"
    elif held in state.attempts:
        why = "retry"
    elif not (snap.healthy and snap.serving):
        why = "unavailable"
    else:
        why = "saturated"
    SESSION_MOVES.labels(why).inc()
    log.info("session_moved", session_id=state.inp.session_id, tenant=state.tenant, reason=why)


class _Watchdog:
    """The progress timeout of one attempt at no cost per chunk: the reader stamps `last`; a
    timer that wakes once per `timeout` cancels the reading task when nothing came for that
    long (an `asyncio.timeout` per chunk cost ~14% of the core's CPU) and the replica's stream
    was silent too (`heard`: a request queued inside a live engine waits its turn, it is not a
    stall; the engine's keepalive and the other requests' tokens show the engine is alive)."""

    def __init__(self, timeout: float, heard: Callable[[], float]) -> None:
        self.loop = asyncio.get_running_loop()
        self.timeout = timeout
        self._heard = heard
        self.last = self.loop.time()
        self.task = asyncio.current_task()
        self.fired = False
        self._handle = self.loop.call_at(self.last + timeout, self._check)

    def _check(self) -> None:
        due = max(self.last, self._heard()) + self.timeout
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
