"""Redis-backed admission: cluster-wide per-tenant concurrency through leases.

Each admitted request holds a lease: a member of the tenant's lease ZSET scored by its expiry.
The in-flight count is ZCARD after dropping expired members, so there is no counter to drift:
a router that dies stops heartbeating and its leases expire. Every operation is one Lua script
(atomic; `register_script` reloads after NOSCRIPT, e.g. a Redis restart), and every key of a
pool shares the hash tag ``{pool}`` so it also runs on Redis Cluster.

The full priority / fair queue builds on these leases (a later issue).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import redis.asyncio as aioredis
from pydantic import Field, field_validator, model_validator
from redis.exceptions import RedisError

from services.config import MaskedUrl, Section, conflict, flag
from services.errors import Reason
from services.logging import get_logger

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
    op_timeout: float = Field(2.0, gt=0, description="seconds one Redis operation may take",
                              json_schema_extra=flag("redis_timeout"))

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


class Admission:
    """Acquire / heartbeat / release tenant leases in Redis."""

    def __init__(self, settings: AdmissionSettings) -> None:
        self.settings = settings
        self.redis = aioredis.from_url(settings.redis_url, socket_timeout=settings.op_timeout,
                                       socket_connect_timeout=settings.op_timeout,
                                       health_check_interval=30)
        self._acquire = self.redis.register_script(_ACQUIRE)
        self._heartbeat = self.redis.register_script(_HEARTBEAT)

    def _key(self, tenant: str) -> str:
        return f"tr:{{{self.settings.pool}}}:leases:{tenant}"

    async def _call(self, fn: Callable[[], Awaitable[T]], what: str) -> T | None:
        # Shielded: a cancelled caller must never leave a reply for the next command on the
        # connection (redis-py asyncio cancellation bugs #2624/#2665).
        try:
            return await asyncio.shield(asyncio.wait_for(fn(), self.settings.op_timeout))
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            if self.settings.fail_open:
                log.warning("redis_unavailable_fail_open", op=what, error=str(exc))
                return None
            raise Reason.REDIS_UNAVAILABLE.error(f"admission store unreachable ({what})") from exc

    async def acquire(self, tenant: str, request_id: str, limit: int) -> int:
        """Take a lease or raise ResourceExhausted. Returns the tenant's in-flight count."""
        ttl_ms = int(self.settings.lease_ttl * 1000)
        result: Any = await self._call(
            lambda: self._acquire(keys=[self._key(tenant)], args=[request_id, limit, ttl_ms]), "acquire")
        if result is None:
            return 0
        granted, value = int(result[0]), int(result[1])
        if not granted:
            raise Reason.TENANT_CONCURRENCY_LIMIT.error(
                f"tenant {tenant!r} has {limit} requests in flight (its limit)", retry_after=value / 1000)
        return value

    async def heartbeat(self, tenant: str, request_id: str) -> bool:
        ttl_ms = int(self.settings.lease_ttl * 1000)
        result = await self._call(
            lambda: self._heartbeat(keys=[self._key(tenant)], args=[request_id, ttl_ms]), "heartbeat")
        return bool(result) if result is not None else True

    async def release(self, tenant: str, request_id: str) -> None:
        with contextlib.suppress(Exception):
            await self._call(lambda: self.redis.zrem(self._key(tenant), request_id), "release")

    async def in_flight(self, tenant: str) -> int:
        key = self._key(tenant)
        ms = await self.redis.time()
        now = ms[0] * 1000 + ms[1] // 1000
        return int(await self.redis.zcount(key, now, "+inf"))

    async def ping(self) -> None:
        await self._call(self.redis.ping, "ping")

    async def close(self) -> None:
        await self.redis.aclose()


class LeaseKeeper:
    """Holds one lease for the life of a request: heartbeats in the background, releases at exit."""

    def __init__(self, admission: Admission, tenant: str, request_id: str) -> None:
        self._admission = admission
        self._tenant = tenant
        self._request_id = request_id
        self._task: asyncio.Task[None] | None = None

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self._admission.settings.heartbeat)
            with contextlib.suppress(Exception):
                if not await self._admission.heartbeat(self._tenant, self._request_id):
                    log.warning("lease_lost", request_id=self._request_id)

    async def __aenter__(self) -> LeaseKeeper:
        self._task = asyncio.create_task(self._beat())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
        await self._admission.release(self._tenant, self._request_id)
