"""Lease-based admission against a real redis-server."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from router_svc.admission import Admission, AdmissionSettings, LeaseKeeper
from services.errors import ResourceExhausted, Unavailable


@pytest.fixture
async def admission(redis_url):
    adm = Admission(AdmissionSettings(redis_url=redis_url, pool=uuid.uuid4().hex, lease_ttl=0.5,
                                      heartbeat_interval=0.1))
    yield adm
    await adm.close()


async def test_concurrency_limit_and_release(admission):
    await admission.acquire("t", "r1", 2)
    await admission.acquire("t", "r2", 2)
    with pytest.raises(ResourceExhausted) as e:
        await admission.acquire("t", "r3", 2)
    assert e.value.reason == "TENANT_CONCURRENCY_LIMIT"
    assert e.value.retry_after is not None and 0 < e.value.retry_after <= 0.5
    await admission.acquire("other", "r3", 2)  # limits are per tenant
    await admission.acquire("t", "r1", 2)  # re-acquiring one's own lease is idempotent
    await admission.release("t", "r1")
    await admission.acquire("t", "r3", 2)
    assert await admission.in_flight("t") == 2


async def test_dead_owner_lease_expires(admission):
    await admission.acquire("t", "dead", 1)
    with pytest.raises(ResourceExhausted):
        await admission.acquire("t", "next", 1)
    # The owner never heartbeats (it "died"): after the TTL its capacity comes back.
    deadline = asyncio.get_running_loop().time() + 5
    while True:
        try:
            await admission.acquire("t", "next", 1)
            break
        except ResourceExhausted:
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.05)
    assert not await admission.heartbeat("t", "dead")  # an expired lease is not revived


async def test_heartbeat_keeps_lease_alive(admission):
    await admission.acquire("t", "held", 1)
    async with LeaseKeeper(admission, "t", "held"):
        await asyncio.sleep(1.2)  # > 2 TTLs: only heartbeats keep it
        with pytest.raises(ResourceExhausted):
            await admission.acquire("t", "other", 1)
    await admission.acquire("t", "other", 1)  # released on exit


async def test_redis_down_fails_closed_or_open(tmp_path):
    url = f"unix://{tmp_path}/nothing.sock"
    closed = Admission(AdmissionSettings(redis_url=url, op_timeout=0.5))
    with pytest.raises(Unavailable) as e:
        await closed.acquire("t", "r", 1)
    assert e.value.reason == "REDIS_UNAVAILABLE"
    await closed.close()
    opened = Admission(AdmissionSettings(redis_url=url, op_timeout=0.5, fail_open=True))
    assert await opened.acquire("t", "r", 1) == 0
    await opened.close()
