"""The engine's entry in the replica registry: routers that read it (``--engine-registry``) add
this engine when it appears, and drop it when its heartbeats stop.

One Redis hash per admission pool, ``tq:{<pool>}:engines`` (the routers' key, router_svc/discovery.py):
field = the address routers dial (``--advertise-address``), value = ``<expiry ms> <json>``, the
expiry computed by Redis from its own clock plus ``--registry-ttl``. Every ``--registry-heartbeat``
seconds, and at once when the engine's health changes (a drain starts, the backend dies), one
script rewrites the entry with the engine's load: its traffic pool, active and queued requests, KV
blocks used / free / total, capacity (max_active), max_context, block size, health and whether it
drains. A clean stop deletes the entry. Redis unreachable: the engine keeps serving (routers with
static lists still reach it), logs once, and keeps trying each heartbeat.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import Callable
from typing import Any

from redis.exceptions import RedisError

from services.logging import get_logger
from services.redis_client import open_redis

from .backends.events import HealthState
from .engine import Engine

log = get_logger(__name__)


def registry_key(pool: str) -> str:
    """router_svc.discovery.registry_key: the two services share the key, not code."""
    return f"tq:{{{pool}}}:engines"


# KEYS[1]: the registry hash; ARGV: address, ttl ms, json. The expiry is Redis's clock + ttl.
_BEAT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('HSET', KEYS[1], ARGV[1], (now + tonumber(ARGV[2])) .. ' ' .. ARGV[3])
return now
"""


def advertise_address(configured: str, host: str, port: int) -> str:
    """What routers dial: ``--advertise-address``, else the bound host:port (a wildcard host is
    replaced by this machine's name)."""
    if configured:
        return configured
    if host in ("0.0.0.0", "::", ""):
        host = socket.getfqdn()
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def engine_report(engine: Engine, address: str, pool: str) -> dict[str, Any]:
    """The entry's body: what a router needs before its first poll of the engine."""
    load, health = engine.load(), engine.health
    return {"v": 1, "address": address, "pool": pool, "backend": load.backend, "model": load.model,
            "active": load.active, "queued": load.queued, "max_active": load.max_active,
            "kv_used": load.kv_blocks_used, "kv_free": max(0, load.kv_blocks_total - load.kv_blocks_used),
            "kv_total": load.kv_blocks_total, "tokens_per_block": load.tokens_per_block,
            "max_context": load.max_context, "health": health.value,
            "draining": health is not HealthState.SERVING}


class Registration:
    """Heartbeats one engine's entry (`start` / `wake` / `close`)."""

    def __init__(self, redis_url: str, registry_pool: str, address: str, report: Callable[[], dict[str, Any]], *,
                 heartbeat: float = 1.0, ttl: float = 3.0, timeout: float = 1.0) -> None:
        self.address = address
        self.key = registry_key(registry_pool)
        self._report = report
        self._heartbeat = heartbeat
        self._ttl_ms = int(ttl * 1000)
        self._timeout = timeout
        self._redis = open_redis(redis_url, timeout, retry_on=None, health_check_interval=0)
        self._beat = self._redis.register_script(_BEAT)
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._failing = False
        self._closed = False
        self.beats = 0          # heartbeats written

    async def start(self) -> None:
        """Write the entry once (awaited, so the engine is listed as soon as it serves), then beat."""
        await self.beat()
        self._task = asyncio.create_task(self._run(), name="engine-registration")

    def wake(self) -> None:
        """Write now (the health changed: routers must hear of a drain before the next beat)."""
        self._wake.set()

    async def _run(self) -> None:
        while not self._closed:   # a flag too: wait_for (3.11) may swallow a cancel that races its result
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._heartbeat)
            self._wake.clear()
            await self.beat()

    async def beat(self) -> bool:
        try:
            body = json.dumps(self._report(), separators=(",", ":"))
            await asyncio.wait_for(self._beat(keys=[self.key], args=[self.address, self._ttl_ms, body]),
                                   self._timeout * 2)
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            if not self._failing:
                self._failing = True
                log.warning("registry_unreachable", key=self.key, address=self.address, error=str(exc) or "timeout",
                            note="still serving; routers with static lists reach this engine")
            return False
        if self._failing or not self.beats:
            log.info("registry_registered", key=self.key, address=self.address)
        self._failing = False
        self.beats += 1
        return True

    async def close(self, deregister: bool = True) -> None:
        """Stop beating and delete the entry (routers retire the replica at their next read);
        ``deregister=False`` leaves it to expire (what a crash does). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._wake.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if not deregister:
            await self._redis.aclose()
            return
        try:
            await asyncio.wait_for(self._redis.hdel(self.key, self.address), self._timeout * 2)
            log.info("registry_deregistered", key=self.key, address=self.address)
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            log.warning("registry_deregister_failed", key=self.key, address=self.address, error=str(exc) or "timeout",
                        note="the entry expires by itself")
        await self._redis.aclose()
