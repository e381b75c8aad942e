"""Helpers for the admission-queue tests: an `Admission` on a private pool of a real redis-server,
requests with defaults, and a direct view of the pool's keys to check invariants."""

from __future__ import annotations

import uuid
from typing import Any

import redis.asyncio as aioredis

from router_svc.admission import Admission, AdmissionSettings
from router_svc.ports import AdmitRequest


async def queue_calls(r: aioredis.Redis) -> int:
    """The admission queue's calls Redis has run: FCALLs of its function library (the default) and
    EVALSHAs of its scripts (`--queue-code scripts`)."""
    stats = await r.info("commandstats")
    return sum(int(stats.get(k, {}).get("calls", 0)) for k in ("cmdstat_fcall", "cmdstat_evalsha"))


def settings(url: str, **kw: Any) -> AdmissionSettings:
    values: dict[str, Any] = {"redis_url": url, "pool": uuid.uuid4().hex[:12], "pool_capacity": 2,
                              "lease_ttl": 5.0, "queue_poll": 0.2, "reap_interval": 0.05,
                              "fair_headroom": 0.0, "slot_hold_ms": 0, **kw}
    return AdmissionSettings(**values)


def admission(url: str, **kw: Any) -> Admission:
    return Admission(settings(url, **kw))


def req(tenant: str, request_id: str, *, priority: int = 2, cost: int = 100, deadline: float = 30.0,
        max_in_flight: int = 100, max_queued: int = 100, tpm: int = 0, weight: float = 1.0) -> AdmitRequest:
    return AdmitRequest(tenant, request_id, priority, cost, deadline, max_in_flight, max_queued, tpm, weight)


class PoolView:
    """The pool's Redis keys, read on a connection of the test's own."""

    def __init__(self, url: str, pool: str) -> None:
        self.r = aioredis.from_url(url)
        self.p = f"tq:{{{pool}}}:"

    async def leases(self) -> int:
        return int(await self.r.zcard(self.p + "leases"))

    async def queued(self, cls: str) -> int:
        return int(await self.r.zcard(self.p + "cq:" + cls))

    async def keys(self) -> list[str]:
        return sorted(k.decode() for k in await self.r.keys(self.p.replace("{", "\\{").replace("}", "\\}") + "*"))

    async def check_invariants(self, classes: list[str]) -> None:
        """Per-class depth == sum of the tenants' queues; every lease in a tenant's lease set and back;
        no queued request without a record; leases never exceed their record."""
        leases = {m.decode() for m in await self.r.zrange(self.p + "leases", 0, -1)}
        tenant_leases: set[str] = set()
        for key in await self.r.keys(self.p.replace("{", "\\{").replace("}", "\\}") + "tl:*"):
            tenant_leases |= {m.decode() for m in await self.r.zrange(key, 0, -1)}
        assert leases == tenant_leases, (leases, tenant_leases)
        for cls in classes:
            members = {m.decode() for m in await self.r.zrange(self.p + "cq:" + cls, 0, -1)}
            per_tenant: set[str] = set()
            for key in await self.r.keys(self.p.replace("{", "\\{").replace("}", "\\}") + f"q:{cls}:*"):
                per_tenant |= {m.decode() for m in await self.r.zrange(key, 0, -1)}
            assert members == per_tenant, (cls, members, per_tenant)
            for m in members:
                assert await self.r.hget(self.p + "r:" + m, "st") == b"q", m
        for m in leases:
            assert await self.r.hget(self.p + "r:" + m, "st") == b"l", m

    async def close(self) -> None:
        await self.r.aclose()


class FakeClock:
    """A clock for the memos' pure logic: `t` seconds, moved by the test."""

    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t
