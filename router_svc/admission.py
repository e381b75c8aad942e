"""Redis-backed admission: cluster-wide per-tenant concurrency through leases.

Each admitted request holds a lease: a member of the tenant's lease ZSET scored by its expiry.
The in-flight count is ZCARD after dropping expired members, so there is no counter to drift:
a router that dies stops heartbeating and its leases expire. Every operation is one Lua script
(atomic; `register_script` reloads after NOSCRIPT, e.g. a Redis restart), and every key of a
pool shares the hash tag ``{pool}`` so it also runs on Redis Cluster.

Per router process: one bounded connection pool (`--redis-max-connections`), one heartbeat task
for all its leases (`LeaseBook`: one script call per tick, whatever the number of requests), and
operations timed so that a stalled event loop never counts as Redis's time (`_watch`): a reply
that waited in the socket while the loop was busy is not REDIS_UNAVAILABLE. A lease is released
on every path: a caller cancelled (deadline, Cancel, client gone) while its acquire was in flight
gets its lease released when Redis grants it; a release that fails (a stale pooled connection
after a Redis restart is retried once on a fresh one) is logged and retried by the heartbeat loop
until it succeeds or the lease would have expired anyway.

The full priority / fair queue builds on these leases (a later issue).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import Any, TypeVar

import redis.asyncio as aioredis
from pydantic import Field, field_validator, model_validator
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from services.config import MaskedUrl, Section, conflict, flag
from services.errors import Reason
from services.logging import get_logger
from services.tasks import OwnedTask

from . import metrics

log = get_logger(__name__)
T = TypeVar("T")

# KEYS[1] lease zset; ARGV: request_id, limit, ttl_ms. Returns {1, count} or {0, retry_after_ms}.
_ACQUIRE = """
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZSCORE', KEYS[1], ARGV[1]) then
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
  return {1, redis.call('ZCARD', KEYS[1])}
end
local n = redis.call('ZCARD', KEYS[1])
if n >= tonumber(ARGV[2]) then
  local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  local wait = 1000
  if first[2] then wait = math.max(tonumber(first[2]) - now, 1) end
  return {0, wait}
end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[3]) * 2)
return {1, n + 1}
"""
# Extend only a lease that still exists (XX): an expired lease is not silently revived.
_HEARTBEAT = """
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local ok = redis.call('ZADD', KEYS[1], 'XX', 'CH', now + tonumber(ARGV[2]), ARGV[1])
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]) * 2)
if redis.call('ZSCORE', KEYS[1], ARGV[1]) then return 1 end
return 0
"""
# Every lease of one router process in one call. KEYS: lease zsets (one per tenant, same {pool});
# ARGV: ttl_ms, then per key: the number of ids, the ids. Returns the ids no longer held, as
# {key index, id} pairs flattened (an expired lease is not revived).
_HEARTBEAT_ALL = """
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local ttl = tonumber(ARGV[1])
local lost = {}
local a = 2
for k = 1, #KEYS do
  local n = tonumber(ARGV[a])
  for i = a + 1, a + n do
    redis.call('ZADD', KEYS[k], 'XX', now + ttl, ARGV[i])
    if not redis.call('ZSCORE', KEYS[k], ARGV[i]) then
      lost[#lost + 1] = k
      lost[#lost + 1] = ARGV[i]
    end
  end
  redis.call('PEXPIRE', KEYS[k], ttl * 2)
  a = a + n + 1
end
return lost
"""
# The loop is "late" when a timer fires more than this after it was due: then an operation's
# time ran on the loop, not in Redis, and it gets more time (at most _MAX_EXTENSIONS times).
_LATE = 0.02
_MAX_EXTENSIONS = 8


class AdmissionSettings(Section):
    """The router's admission section: where the leases live and how they are kept."""

    redis_url: MaskedUrl = Field("redis://127.0.0.1:6379/0", description="Redis URL (redis://, rediss://, "
                                 "unix://); a password in it is never logged")
    pool: str = Field("default", min_length=1, description="admission pool name (Redis key hash tag)")
    lease_ttl: float = Field(15.0, gt=0, description="seconds a request lease lives without a heartbeat")
    heartbeat_interval: float | None = Field(None, gt=0, json_schema_extra=flag("lease_heartbeat"),
                                             description="seconds between a lease's heartbeats (unset = a third "
                                                         "of --lease-ttl)")
    fail_open: bool = Field(False, description="admit requests when Redis is unreachable (default: reject)")
    op_timeout: float = Field(2.0, gt=0, description="seconds one Redis operation may take (time the "
                              "router's own event loop was stalled is not counted)",
                              json_schema_extra=flag("redis_timeout"))
    max_connections: int = Field(8, ge=1, le=256, json_schema_extra=flag("redis_max_connections"),
                                 description="Redis connections per router process (one bounded pool; "
                                             "operations wait for a free one)")

    @field_validator("redis_url")
    @classmethod
    def _scheme(cls, url: str) -> str:
        if not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("must start with redis://, rediss:// or unix://")
        return url

    @model_validator(mode="after")
    def _heartbeat_within_ttl(self) -> AdmissionSettings:
        if self.heartbeat_interval is not None and self.heartbeat_interval >= self.lease_ttl:
            raise conflict("the lease heartbeat must be shorter than the lease TTL", "heartbeat_interval",
                           "lease_ttl")
        return self

    @property
    def heartbeat(self) -> float:
        return self.heartbeat_interval if self.heartbeat_interval is not None else self.lease_ttl / 3


def _retrieve(op: asyncio.Future[Any]) -> None:
    """Mark an abandoned operation's outcome as seen (its failure was already reported)."""
    if not op.cancelled():
        op.exception()


class Admission:
    """Acquire / heartbeat / release tenant leases in Redis (one per router process)."""

    def __init__(self, settings: AdmissionSettings) -> None:
        self.settings = settings
        # redis-py's own timeouts are loop timers too, so they are only a backstop far beyond
        # op_timeout; `_watch` times operations. Retried once on a fresh connection: every
        # script is idempotent (acquire of a held lease, ZADD XX, ZREM).
        backstop = settings.op_timeout * (_MAX_EXTENSIONS + 2)
        pool = aioredis.BlockingConnectionPool.from_url(
            settings.redis_url, max_connections=settings.max_connections, timeout=backstop,
            socket_timeout=backstop, socket_connect_timeout=settings.op_timeout, health_check_interval=30,
            retry=Retry(NoBackoff(), 1), retry_on_error=[RedisConnectionError])
        self.redis = aioredis.Redis.from_pool(pool)
        self._acquire = self.redis.register_script(_ACQUIRE)
        self._heartbeat = self.redis.register_script(_HEARTBEAT)
        self._heartbeat_all = self.redis.register_script(_HEARTBEAT_ALL)
        self.leases = LeaseBook(self)
        self._background: set[asyncio.Future[Any]] = set()

    def _key(self, tenant: str) -> str:
        return f"tr:{{{self.settings.pool}}}:leases:{tenant}"

    def _spawn(self, coro: Awaitable[T]) -> asyncio.Task[T]:
        task: asyncio.Task[T] = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def _watch(self, op: asyncio.Future[T], what: str) -> T:
        """`op`'s result within op_timeout of *Redis's* time. Never cancels `op` (a command cut off
        mid-reply would poison its connection); a caller cancelled here leaves it running."""
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        due = t0 + self.settings.op_timeout
        extensions = 0
        try:
            while True:
                await asyncio.wait((op,), timeout=max(0.0, due - loop.time()))
                if op.done():
                    return op.result()
                late = loop.time() - due
                if late <= _LATE or extensions >= _MAX_EXTENSIONS:
                    metrics.REDIS_FAILURES.labels(what, "timeout").inc()
                    raise asyncio.TimeoutError(f"no reply in {loop.time() - t0:.3f}s")
                # The timer ran late: the loop was stalled or saturated, and the reply may be waiting
                # in the socket. Give it the loop's lateness again (at least 0.1 s).
                extensions += 1
                due = loop.time() + min(self.settings.op_timeout, max(0.1, 2 * late))
        finally:
            metrics.REDIS_SECONDS.labels(what).observe(loop.time() - t0)
            if not op.done():   # given up (timeout) or the caller cancelled: it runs on, tracked
                op.add_done_callback(_retrieve)
                self._background.add(op)
                op.add_done_callback(self._background.discard)

    async def _call(self, op: asyncio.Future[T], what: str) -> T | None:
        try:
            return await self._watch(op, what)
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            if not isinstance(exc, asyncio.TimeoutError):
                metrics.REDIS_FAILURES.labels(what, "error").inc()
            if self.settings.fail_open:
                log.warning("redis_unavailable_fail_open", op=what, error=str(exc))
                return None
            raise Reason.REDIS_UNAVAILABLE.error(f"admission store unreachable ({what})") from exc

    async def acquire(self, tenant: str, request_id: str, limit: int) -> int:
        """Take a lease or raise ResourceExhausted. Returns the tenant's in-flight count.

        If the caller does not get the answer (cancelled, its deadline, a timeout) while Redis
        may still grant the lease, the lease is released once granted: no lease outlives its
        request for a TTL."""
        ttl_ms = int(self.settings.lease_ttl * 1000)
        op = asyncio.ensure_future(self._acquire(keys=[self._key(tenant)], args=[request_id, limit, ttl_ms]))
        try:
            result: Any = await self._call(op, "acquire")
        except BaseException:
            self._release_if_granted(op, tenant, request_id)
            raise
        if result is None:  # fail-open: admitted without a lease; one granted later is released
            self._release_if_granted(op, tenant, request_id)
            return 0
        granted, value = int(result[0]), int(result[1])
        if not granted:
            raise Reason.TENANT_CONCURRENCY_LIMIT.error(
                f"tenant {tenant!r} has {limit} requests in flight (its limit)", retry_after=value / 1000)
        return value

    def _release_if_granted(self, op: asyncio.Future[Any], tenant: str, request_id: str) -> None:
        def settle(done: asyncio.Future[Any]) -> None:
            if done.cancelled() or done.exception() is not None:
                return  # never granted (or unknown: the heartbeat loop does not know it, the TTL frees it)
            if int(done.result()[0]):
                log.info("lease_released_after_abandoned_acquire", tenant=tenant, request_id=request_id)
                self._spawn(self._release(tenant, request_id))
        op.add_done_callback(settle)

    async def heartbeat(self, tenant: str, request_id: str) -> bool:
        ttl_ms = int(self.settings.lease_ttl * 1000)
        op = asyncio.ensure_future(self._heartbeat(keys=[self._key(tenant)], args=[request_id, ttl_ms]))
        result = await self._call(op, "heartbeat")
        return bool(result) if result is not None else True

    async def heartbeat_all(self, leases: dict[str, list[str]]) -> list[tuple[str, str]]:
        """Extend every lease of `leases` (tenant -> request ids) in one call; the (tenant, id)
        pairs no longer held are returned."""
        tenants = list(leases)
        args: list[Any] = [int(self.settings.lease_ttl * 1000)]
        for tenant in tenants:
            args.append(len(leases[tenant]))
            args.extend(leases[tenant])
        op = asyncio.ensure_future(self._heartbeat_all(keys=[self._key(t) for t in tenants], args=args))
        lost: Any = await self._call(op, "heartbeat")
        if not lost:
            return []
        return [(tenants[int(lost[i]) - 1], lost[i + 1].decode() if isinstance(lost[i + 1], bytes) else lost[i + 1])
                for i in range(0, len(lost), 2)]

    async def release(self, tenant: str, request_id: str) -> None:
        """Release a lease. Runs to the end even if the caller is cancelled; a failure is logged
        and retried by the heartbeat loop (never raised: the request is over either way)."""
        await asyncio.shield(self._spawn(self._release(tenant, request_id)))

    async def _release(self, tenant: str, request_id: str) -> bool:
        try:
            op = asyncio.ensure_future(self.redis.zrem(self._key(tenant), request_id))
            await self._watch(op, "release")
            self.leases.released(tenant, request_id)
            return True
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            log.warning("lease_release_failed", tenant=tenant, request_id=request_id, error=repr(exc),
                        retry="heartbeat loop")
            self.leases.release_later(tenant, request_id)
            return False

    async def in_flight(self, tenant: str) -> int:
        key = self._key(tenant)
        ms = await self.redis.time()
        now = ms[0] * 1000 + ms[1] // 1000
        return int(await self.redis.zcount(key, now, "+inf"))

    async def ping(self) -> None:
        await self._call(asyncio.ensure_future(self.redis.ping()), "ping")

    async def close(self) -> None:
        await self.leases.close()
        if self._background:
            await asyncio.wait(set(self._background), timeout=self.settings.op_timeout)
            for op in list(self._background):   # an operation Redis never answered
                op.cancel()
        await self.redis.aclose()


class LeaseBook:
    """Every lease of this router process, kept alive by one task: each heartbeat interval one
    script call extends all of them and retries the releases that failed."""

    def __init__(self, admission: Admission) -> None:
        self._admission = admission
        self._held: dict[str, set[str]] = {}
        self._pending: dict[tuple[str, str], float] = {}   # failed releases -> give up after (monotonic)
        self._task = OwnedTask("lease-heartbeats")

    def __len__(self) -> int:
        return sum(len(ids) for ids in self._held.values())

    @property
    def pending_releases(self) -> int:
        return len(self._pending)

    def add(self, tenant: str, request_id: str) -> None:
        self._held.setdefault(tenant, set()).add(request_id)
        metrics.LEASES_HELD.inc()
        self._task.ensure(self._run)

    def discard(self, tenant: str, request_id: str) -> None:
        ids = self._held.get(tenant)
        if ids is not None and request_id in ids:
            ids.discard(request_id)
            metrics.LEASES_HELD.dec()
            if not ids:
                del self._held[tenant]

    def release_later(self, tenant: str, request_id: str) -> None:
        self._pending[(tenant, request_id)] = time.monotonic() + self._admission.settings.lease_ttl
        metrics.LEASE_RELEASE_RETRIES.inc()
        self._task.ensure(self._run)

    def released(self, tenant: str, request_id: str) -> None:
        self._pending.pop((tenant, request_id), None)

    async def _run(self) -> None:
        while self._held or self._pending:
            await asyncio.sleep(self._admission.settings.heartbeat)
            await self.tick()

    async def tick(self) -> None:
        """One round: extend every held lease, retry every failed release."""
        now = time.monotonic()
        for key, give_up in list(self._pending.items()):
            if now > give_up:  # expired in Redis by now
                self._pending.pop(key, None)
            else:
                await self._admission._release(*key)
        if not self._held:
            return
        try:
            lost = await self._admission.heartbeat_all({t: sorted(ids) for t, ids in self._held.items()})
        except Exception as exc:  # noqa: BLE001 - the next tick tries again; the TTL allows ~3
            log.warning("lease_heartbeat_failed", leases=len(self), error=repr(exc))
            return
        for tenant, request_id in lost:
            log.warning("lease_lost", tenant=tenant, request_id=request_id)

    async def close(self) -> None:
        await self._task.close()


class LeaseKeeper:
    """Holds one lease for the life of a request: heartbeated by the process's `LeaseBook`,
    released at exit (even when the exit is a cancellation)."""

    def __init__(self, admission: Admission, tenant: str, request_id: str) -> None:
        self._admission = admission
        self._tenant = tenant
        self._request_id = request_id

    async def __aenter__(self) -> LeaseKeeper:
        self._admission.leases.add(self._tenant, self._request_id)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._admission.leases.discard(self._tenant, self._request_id)
        await self._admission.release(self._tenant, self._request_id)
