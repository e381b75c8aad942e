"""Shadow traffic: mirror a share of requests to a second engine pool and record how it answers.

`ShadowMirror` implements `ports.Shadow`. When the engine stage has placed a request's primary
(`started`), a deterministic share of requests (blake2b of tenant + request id against the
split's shadow fraction, so a retried id is mirrored or not alike on every router) is submitted
again, same prompt and sampling, to a replica of the shadow pool, straight through the engine
stream: outside admission (the tenant is neither charged nor limited by it), at low priority,
with the primary's deadline. Its tokens go nowhere but here: never to the client's detokenizer
or stream. When both have ended it records the shadow's time to first token and to its last
token against the primary's (both measured from the shadow's submission, the moment the primary
was placed; the primary's first token is when the client's first delta was written, so its TTFT
includes the detokenizer's hop, ~1 ms), the token-level divergence (the first index where the
ids differ, the share of positions that match; for greedy requests on the same model and build
a match is expected, sampled ones without a seed diverge by construction) and any shadow error:
as metrics (``tokenrelay_router_shadow_*``), one ``shadow_done`` log line per request, and, with
a Redis stream length set, an entry in the capped stream ``tq:{pool}:shadow`` for offline
comparison.

Bounded and harmless: at most `max_in_flight` shadows at once (more are dropped and counted);
a shadow gets at most `timeout` seconds; no replica in the shadow pool, a refusal or a broken
stream is a counted result, never an error of the primary; a request whose primary already runs
on the shadow pool is not mirrored. A primary that is cancelled or fails aborts its shadow.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from services.errors import Reason, TokenrelayError
from services.logging import get_logger

from .metrics import (
    SHADOW_DIVERGENCE,
    SHADOW_E2E_RATIO,
    SHADOW_IN_FLIGHT,
    SHADOW_REQUESTS,
    SHADOW_TTFT_RATIO,
)
from .pools import SplitConfig, SplitSelector, SplitStore, unit_hash
from .ports import EngineStream, Placement, PlacementView
from .request import RequestState
from .types import EngineChunk

if TYPE_CHECKING:
    from .admission_settings import AdmissionSettings
    from .config import PoolSettings

log = get_logger(__name__)

_LOW = 1   # the priority shadows run at: a shared engine serves its primaries first


@dataclass(frozen=True)
class Divergence:
    first_diff: int        # first index where the ids differ; -1 = identical
    match_ratio: float     # positions equal / the longer answer's length (1.0 for two empty ones)

    @property
    def exact(self) -> bool:
        return self.first_diff < 0


def divergence(primary: Sequence[int], shadow: Sequence[int]) -> Divergence:
    longest = max(len(primary), len(shadow))
    if not longest:
        return Divergence(-1, 1.0)
    same = sum(1 for a, b in zip(primary, shadow, strict=False) if a == b)
    first = next((i for i, (a, b) in enumerate(zip(primary, shadow, strict=False)) if a != b),
                 -1 if len(primary) == len(shadow) else min(len(primary), len(shadow)))
    return Divergence(first, same / longest)


def sampled(fraction: float, tenant: str, request_id: str) -> bool:
    """Is this request mirrored? Deterministic in (tenant, request id)."""
    return fraction >= 1.0 or (fraction > 0 and unit_hash("shadow", f"{tenant}\0{request_id}") < fraction)


@dataclass
class _Shadow:
    """One mirrored request: the primary's state and the shadow's own record."""

    state: RequestState
    pool: str
    address: str
    upstream_id: str
    t_submit: float
    task: asyncio.Task[None] | None = None
    tokens: list[int] = field(default_factory=list)
    t_first: float | None = None
    t_end: float | None = None
    error: str = ""
    primary_end: float | None = None
    primary_ok: bool = False
    primary_done: asyncio.Event = field(default_factory=asyncio.Event)


class ShadowMirror:
    """`ports.Shadow`: reads the shadow pool and fraction from `config()` per request (the split
    being served, so `tokenrelay split set --shadow` changes them at runtime)."""

    def __init__(self, engines: EngineStream, placement: Placement, config: Callable[[], SplitConfig],
                 eos_ids: Callable[[], list[int]], *, max_in_flight: int = 64, timeout: float = 120.0,
                 record: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.engines = engines
        self.placement = placement
        self._config = config
        self._eos = eos_ids
        self.max_in_flight = max_in_flight
        self.timeout = timeout
        self._record = record
        self._running: dict[str, _Shadow] = {}      # by the primary's upstream id
        self._counters: dict[tuple[str, str], Any] = {}

    @property
    def in_flight(self) -> int:
        return len(self._running)

    def _count(self, pool: str, result: str) -> None:
        counter = self._counters.get((pool, result))
        if counter is None:
            counter = self._counters[(pool, result)] = SHADOW_REQUESTS.labels(pool, result)
        counter.inc()

    # -- ports.Shadow ---------------------------------------------------------------------------
    def started(self, state: RequestState) -> None:
        try:
            self._start(state)
        except Exception as exc:  # noqa: BLE001 - a shadow never fails its primary
            log.warning("shadow_start_failed", request_id=state.request_id, error=repr(exc))

    def finished(self, state: RequestState) -> None:
        shadow = self._running.get(state.upstream_id)
        if shadow is None or shadow.primary_done.is_set():
            return
        shadow.primary_end = time.monotonic()
        # Ended by its engine without an error, not cancelled, not past its deadline (which also marks
        # it engine_done).
        shadow.primary_ok = (state.engine_done and state.error is None and not state.is_cancelled
                             and state.remaining() > 0)
        shadow.primary_done.set()
        if not shadow.primary_ok and shadow.t_end is None and shadow.task is not None:
            shadow.task.cancel()      # it aborts the shadow on the engine

    # -------------------------------------------------------------------------------------------
    def _start(self, state: RequestState) -> None:
        config = self._config()
        pool = config.shadow_pool
        if not pool or state.pool == pool or state.upstream_id in self._running:
            return
        if not sampled(config.shadow_fraction, state.tenant, state.request_id):
            return
        if len(self._running) >= self.max_in_flight:
            self._count(pool, "dropped")
            return
        replicas = [s for s in self.engines.snapshots() if s.pool == pool]
        view = PlacementView(state.tenant, "", len(state.prompt_ids), pool=pool, prompt_ids=state.prompt_ids,
                             cache_salt=state.tenant)
        upstream_id = f"shadow-{state.upstream_id}"
        try:
            address = self.placement.choose(replicas, view)
            t_submit = time.monotonic()
            source = self.engines.submit(address, upstream_id, list(state.prompt_ids), state.inp.sampling,
                                         self._eos(), state.tenant, {},
                                         timeout=min(state.remaining(), self.timeout), priority=_LOW)
        except TokenrelayError:   # NO_HEALTHY_REPLICA (or it left the pool just now): the primary goes on
            self._count(pool, "no_replica")
            return
        shadow = _Shadow(state, pool, address, upstream_id, t_submit)
        self._running[state.upstream_id] = shadow
        SHADOW_IN_FLIGHT.set(len(self._running))
        shadow.task = asyncio.create_task(self._follow(shadow, source), name="shadow")
        shadow.task.add_done_callback(functools.partial(self._ended, shadow))

    async def _follow(self, shadow: _Shadow, source: Any) -> None:
        try:
            await asyncio.wait_for(self._read(shadow, source), self.timeout)
        except asyncio.TimeoutError:
            shadow.error = str(Reason.DEADLINE_EXCEEDED)
            self.engines.abort(shadow.address, shadow.upstream_id)
            shadow.t_end = time.monotonic()
        # The primary usually ends first; wait for it (bounded by its own deadline).
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(shadow.primary_done.wait(), max(0.0, shadow.state.remaining()) + 1.0)
        self._report(shadow)

    def _ended(self, shadow: _Shadow, task: asyncio.Task[None]) -> None:
        """However the shadow's task ended (a cancel may land before it first ran): abort what is
        left on the engine, release it, forget it."""
        if task.cancelled():
            if shadow.t_end is None:
                self.engines.abort(shadow.address, shadow.upstream_id)
            self._count(shadow.pool, "aborted")
        elif task.exception() is not None:
            log.warning("shadow_failed", request_id=shadow.state.request_id, error=repr(task.exception()))
        self.engines.release(shadow.address, shadow.upstream_id)
        self._running.pop(shadow.state.upstream_id, None)
        SHADOW_IN_FLIGHT.set(len(self._running))

    async def _read(self, shadow: _Shadow, source: Any) -> None:
        while True:
            item = await source.get()
            if not isinstance(item, EngineChunk):
                shadow.error = str(getattr(getattr(item, "error", None), "reason", "")
                                or Reason.UPSTREAM_UNAVAILABLE)
                shadow.t_end = time.monotonic()
                return
            if item.token_ids:
                if shadow.t_first is None:
                    shadow.t_first = time.monotonic()
                shadow.tokens.extend(item.token_ids)
            if item.error_reason:
                shadow.error = item.error_reason
            if item.finished or item.error_reason:
                shadow.t_end = time.monotonic()
                return

    def _report(self, shadow: _Shadow) -> None:
        state, pool = shadow.state, shadow.pool
        if not shadow.primary_ok:
            self._count(pool, "aborted")
            return
        record: dict[str, Any] = {
            "request_id": state.request_id, "tenant": state.tenant, "shadow_pool": pool,
            "primary_pool": state.pool, "primary_replica": state.replica, "shadow_replica": shadow.address,
            "greedy": state.inp.sampling.temperature == 0, "primary_tokens": len(state.generated),
            "shadow_tokens": len(shadow.tokens)}
        if shadow.error:
            self._count(pool, "error")
            record.update(result="error", error=shadow.error)
        else:
            d = divergence(state.generated, shadow.tokens)
            result = "match" if d.exact else "diverged"
            self._count(pool, result)
            SHADOW_DIVERGENCE.labels(pool).observe(1.0 - d.match_ratio)
            record.update(result=result, first_diff=d.first_diff, match_ratio=round(d.match_ratio, 4))
            self._timings(shadow, record)
        log.info("shadow_done", **record)
        if self._record is not None:
            self._record(record)

    def _timings(self, shadow: _Shadow, record: dict[str, Any]) -> None:
        t0, state = shadow.t_submit, shadow.state
        primary_first = state.t_first if state.t_first is not None and state.t_first >= t0 else shadow.primary_end
        primary_total = (shadow.primary_end or t0) - t0
        shadow_total = (shadow.t_end or t0) - t0
        record.update(shadow_e2e_ms=round(shadow_total * 1000, 2), primary_e2e_ms=round(primary_total * 1000, 2))
        if primary_total > 0:
            SHADOW_E2E_RATIO.labels(shadow.pool).observe(shadow_total / primary_total)
        if shadow.t_first is not None and primary_first is not None:
            shadow_ttft, primary_ttft = shadow.t_first - t0, primary_first - t0
            record.update(shadow_ttft_ms=round(shadow_ttft * 1000, 2), primary_ttft_ms=round(primary_ttft * 1000, 2))
            if primary_ttft > 0:
                SHADOW_TTFT_RATIO.labels(shadow.pool).observe(shadow_ttft / primary_ttft)

    async def close(self) -> None:
        """Abort every shadow in flight (shutdown)."""
        tasks = [s.task for s in self._running.values() if s.task is not None]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=2.0)


class ShadowStream:
    """Appends shadow records to the capped Redis stream ``tq:{pool}:shadow`` (fire and forget,
    bounded; a failure is logged once per 10 s, never raised)."""

    def __init__(self, redis: Any, pool: str, max_len: int, op_timeout: float = 1.0) -> None:
        self.redis = redis
        self.key = f"tq:{{{pool}}}:shadow"
        self.max_len = max_len
        self.op_timeout = op_timeout
        self._pending: set[asyncio.Task[None]] = set()
        self._last_warn = -1e9

    def __call__(self, record: dict[str, Any]) -> None:
        if len(self._pending) >= 64:       # Redis slow: drop records rather than pile up tasks
            return
        task = asyncio.create_task(self._add(record), name="shadow-record")
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _add(self, record: dict[str, Any]) -> None:
        fields = {k: str(v) for k, v in record.items()}
        try:
            await asyncio.wait_for(self.redis.xadd(self.key, fields, maxlen=self.max_len, approximate=True),
                                   self.op_timeout)
        except Exception as exc:  # noqa: BLE001 - a lost record is only a lost record
            now = time.monotonic()
            if now - self._last_warn > 10:
                self._last_warn = now
                log.warning("shadow_record_failed", error=repr(exc))


class PoolControl:
    """The wiring of engine pools for `app.py`: the split store (Redis), the `ports.PoolSelector`
    over it, the shadow mirror and its optional record stream. Owns their tasks (`start` / `close`)."""

    def __init__(self, pools: PoolSettings, admission: AdmissionSettings, engines: EngineStream,
                 placement: Placement, eos_ids: Callable[[], list[int]]) -> None:
        initial = SplitConfig.build(pools.traffic_split, pools.shadow_pool, pools.shadow_fraction)
        self.store = SplitStore(initial, admission.redis_url, admission.pool, poll_interval=pools.split_poll_interval,
                                op_timeout=min(admission.op_timeout, 1.0), redis_options=admission.redis_options())
        self.selector = SplitSelector(self.store.split, engines.snapshots, pools.split_sticky)
        record = None
        if pools.shadow_record_stream and self.store.redis is not None:
            record = ShadowStream(self.store.redis, admission.pool, pools.shadow_record_stream)
        self.shadow = ShadowMirror(engines, placement, lambda: self.store.config, eos_ids,
                                   max_in_flight=pools.shadow_max_in_flight, timeout=pools.shadow_timeout,
                                   record=record)

    async def start(self) -> None:
        await self.store.start()
        log.info("traffic_split", sticky=self.selector.sticky, **self.store.config.describe())

    async def close(self) -> None:
        await self.shadow.close()
        await self.store.close()
