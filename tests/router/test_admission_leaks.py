"""Admission defects of issue 10, each reproduced against a real redis-server of the test's own
(restartable, AOF so leases survive a kill -9 as a production Redis with persistence does), kept
for the admission queue of issue 11:

- a deadline or cancel that hits while the enqueue is in flight leaked the lease for its TTL;
- a settle on a stale pooled connection after a Redis restart was swallowed unlogged;
- one Redis connection per concurrent request;
- a stalled event loop turned a healthy Redis into REDIS_UNAVAILABLE;
- a heartbeat task per request.
"""

from __future__ import annotations

import asyncio
import signal
import time
import uuid

import pytest
import redis.asyncio as aioredis
import structlog.testing

from router_svc.admission import Admission, AdmissionSettings
from services.errors import ResourceExhausted
from tests.redisproc import RedisProc
from tests.router.admission_kit import queue_calls, req
from tests.waiting import poll


def _admission(url: str, **kw: object) -> Admission:
    settings: dict[str, object] = {"redis_url": url, "pool": uuid.uuid4().hex, "lease_ttl": 30.0,
                                   "pool_capacity": 1000, "reap_interval": 30.0, **kw}
    return Admission(AdmissionSettings(**settings))  # type: ignore[arg-type]


async def _count(url: str, adm: Admission, tenant: str) -> int:
    """Leases held by `tenant`, read on a connection of its own."""
    r = aioredis.from_url(url)
    try:
        return int(await r.zcard(f"tq:{{{adm.settings.pool}}}:tl:{tenant}"))
    finally:
        await r.aclose()


@pytest.mark.parametrize("how", ["deadline", "cancel"])
async def test_lease_granted_after_caller_gave_up_is_released(redis_proc: RedisProc, how: str) -> None:
    adm = _admission(redis_proc.url)
    other = aioredis.from_url(redis_proc.url)
    try:
        warm = await adm.admit(req("t", "warm"))   # loads the script, so the paused call is the enqueue itself
        await warm.grant.settle_tokens(0)
        await asyncio.wait_for(adm.book.listening.wait(), 5)   # the grant listener holds one connection
        calls = await queue_calls(other)
        await other.execute_command("CLIENT", "PAUSE", 500, "WRITE")   # Redis holds the enqueue...
        task = asyncio.ensure_future(adm.admit(req("t", "r1")))
        if how == "deadline":
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.1):            # ...while the request's deadline passes
                    await task
        else:
            await poll(lambda: _enqueue_sent(adm), what="enqueue sent")
            task.cancel()                                   # ...or the client cancels
            with pytest.raises(asyncio.CancelledError):
                await task
        # Redis runs the enqueue when the pause ends and grants the lease to nobody:
        await poll(lambda: _granted(other, calls), timeout=5, what="the paused enqueue ran")
        await poll(lambda: _zero(redis_proc.url, adm, "t"), timeout=3, what="the lease released")
    finally:
        await other.aclose()
        await adm.close()


def _enqueue_sent(adm: Admission) -> bool:
    """The enqueue is on its way to Redis: on the lean client's connection, or holding a pooled one."""
    if adm.lean is not None:
        conn = adm.lean._conn
        return conn is not None and len(conn.waiting) >= 1
    return len(adm.redis.connection_pool._in_use_connections) >= 2


async def _granted(r: aioredis.Redis, calls: int) -> bool:
    return await queue_calls(r) > calls


async def _zero(url: str, adm: Admission, tenant: str) -> bool:
    return await _count(url, adm, tenant) == 0


async def test_settle_after_redis_restart_frees_the_slot(redis_proc: RedisProc) -> None:
    adm = _admission(redis_proc.url)
    try:
        # Several pooled connections, each used once, then Redis dies and comes back (AOF: leases kept).
        held = await asyncio.gather(*(adm.admit(req("t", f"r{i}")) for i in range(4)))
        assert await _count(redis_proc.url, adm, "t") == 4
        redis_proc.kill()
        redis_proc.start()
        assert await _count(redis_proc.url, adm, "t") == 4
        for x in held:   # each settle may land on a connection that died with the old server
            await x.grant.settle_tokens(1)
        assert await _count(redis_proc.url, adm, "t") == 0
    finally:
        await adm.close()


async def test_settle_while_redis_is_down_is_retried_and_logged(redis_proc: RedisProc) -> None:
    adm = _admission(redis_proc.url, op_timeout=0.5, heartbeat_interval=0.1)
    try:
        x = await adm.admit(req("t", "r1"))
        redis_proc.kill()
        with structlog.testing.capture_logs() as logs:
            await x.grant.settle_tokens(1)         # fails: logged, and kept for the heartbeat loop
        assert [e["event"] for e in logs if "lease" in e["event"]] == ["lease_settle_failed"]
        assert len(adm.book._pending) == 1
        redis_proc.start()
        await poll(lambda: _zero(redis_proc.url, adm, "t"), timeout=5, what="the retried settle")
        await poll(lambda: not adm.book._pending, what="nothing left to retry")
    finally:
        await adm.close()


def _hog(loop: asyncio.AbstractEventLoop, until: float, each: float) -> None:
    """A saturated loop: every iteration spends `each` seconds in this callback, until `until`."""
    time.sleep(each)
    if time.monotonic() < until:
        loop.call_soon(_hog, loop, until, each)


async def test_a_stalled_or_busy_loop_is_not_redis_unavailable(redis_proc: RedisProc) -> None:
    adm = _admission(redis_proc.url, op_timeout=0.2)
    try:
        await adm.admit(req("t", "warm"))
        loop = asyncio.get_running_loop()
        task = asyncio.ensure_future(adm.admit(req("t", "r1")))
        loop.call_soon(time.sleep, 0.8)             # one stall while Redis answers at once
        first = await task
        assert first.grant is not None
        # A busy loop: each iteration takes 0.15 s, so an operation's few iterations outlast
        # op_timeout (0.2 s) although Redis answers in microseconds.
        loop.call_soon(_hog, loop, time.monotonic() + 1.5, 0.15)
        results = await asyncio.gather(*(adm.admit(req("t", f"b{i}")) for i in range(10)),
                                       first.grant.settle_tokens(1), return_exceptions=True)
        assert [r for r in results if isinstance(r, BaseException)] == []
        assert await _count(redis_proc.url, adm, "t") == 11
        assert not adm.book._pending
    finally:
        await adm.close()


def _burn(loop: asyncio.AbstractEventLoop, until: float, each: float) -> None:
    """A loop saturated by CPU work (not a sleep): every iteration computes for `each` seconds."""
    t = time.perf_counter()
    while time.perf_counter() - t < each:
        pass
    if time.monotonic() < until:
        loop.call_soon(_burn, loop, until, each)


async def test_a_process_behind_its_calls_refuses_new_requests_early(redis_url: str) -> None:
    # One call per script in flight (5 connections), the loop computing 0.1 s per iteration and 20
    # requests arriving per iteration: more than the process keeps up with. Before, every request
    # waited for its turn later and later until enqueues and the settles behind them timed out;
    # now a request that arrives while calls wait longer than op_timeout / 4 for their turn is
    # refused at once with ROUTER_OVERLOADED, and every request admitted is settled. (A Redis
    # without fsync: a slow disk would make Redis, not this process, the slow one.)
    adm = _admission(redis_url, op_timeout=0.4, max_connections=5)
    try:
        await (await adm.admit(req("t", "warm"))).grant.settle_tokens(0)
        loop = asyncio.get_running_loop()
        outcomes: list[tuple[str, float]] = []

        async def one(i: int) -> None:
            t0 = time.monotonic()
            try:
                x = await adm.admit(req("t", f"r{i}", max_in_flight=10_000))
            except Exception as exc:  # noqa: BLE001 - every outcome is asserted on below
                outcomes.append((str(getattr(exc, "reason", type(exc).__name__)), time.monotonic() - t0))
                return
            assert x.grant is not None
            await x.grant.settle_tokens(1)
            outcomes.append(("settled", time.monotonic() - t0))

        loop.call_soon(_burn, loop, time.monotonic() + 2.0, 0.1)
        tasks = []
        for i in range(15):
            tasks += [asyncio.ensure_future(one(i * 20 + j)) for j in range(20)]
            await asyncio.sleep(0)
        await asyncio.wait_for(asyncio.gather(*tasks), 20)
        reasons = {r for r, _ in outcomes}
        assert reasons <= {"settled", "ROUTER_OVERLOADED"}, reasons     # nothing timed out
        refused = [t for r, t in outcomes if r == "ROUTER_OVERLOADED"]
        assert refused and max(refused) < 0.35, refused                 # refused at once, not after a wait
        assert "settled" in reasons
        await poll(lambda: not adm.book._pending, what="nothing left to retry")
        assert await _count(redis_url, adm, "t") == 0 and not adm.book.leases
    finally:
        await adm.close()


async def test_redis_that_does_not_answer_is_still_unavailable(redis_proc: RedisProc) -> None:
    adm = _admission(redis_proc.url, op_timeout=0.3)
    try:
        await adm.admit(req("t", "warm"))
        assert redis_proc.proc is not None
        redis_proc.proc.send_signal(signal.SIGSTOP)      # a hung Redis, on a loop that is on time
        try:
            t0 = time.monotonic()
            with pytest.raises(Exception) as e:
                await adm.admit(req("t", "r1"))
            assert getattr(e.value, "reason", None) == "REDIS_UNAVAILABLE"
            assert 0.25 < time.monotonic() - t0 < 1.5
        finally:
            redis_proc.proc.send_signal(signal.SIGCONT)
    finally:
        await adm.close()


async def test_one_bounded_pool_per_process(redis_proc: RedisProc) -> None:
    adm = _admission(redis_proc.url, max_connections=4)
    other = aioredis.from_url(redis_proc.url)
    try:
        await asyncio.gather(*(adm.admit(req("t", f"r{i}", max_in_flight=1000)) for i in range(200)))
        clients = await other.client_list()
        assert len(clients) <= 4 + 1, len(clients)       # the pool's (its grant listener's included) and this one
        assert await _count(redis_proc.url, adm, "t") == 200
    finally:
        await other.aclose()
        await adm.close()


async def test_one_heartbeat_task_and_call_for_all_leases(redis_proc: RedisProc) -> None:
    adm = _admission(redis_proc.url, lease_ttl=0.5, heartbeat_interval=0.1, queue_poll=0.1)
    other = aioredis.from_url(redis_proc.url)
    try:
        held = [await adm.admit(req("t" if i % 2 else "u", f"r{i}", max_in_flight=25)) for i in range(50)]
        tasks = [t for t in asyncio.all_tasks() if t.get_name() == "admission-heartbeats"]
        assert len(tasks) == 1                             # one task for all 50 leases
        calls = await queue_calls(other)
        await asyncio.sleep(1.2)                           # > 2 TTLs: only heartbeats keep them
        ticks = await queue_calls(other) - calls
        assert 3 <= ticks <= 15, ticks                     # one call per tick, not one per lease
        with pytest.raises(ResourceExhausted):
            await adm.admit(req("t", "extra", max_in_flight=25, max_queued=0))
        for x in held:
            await x.grant.settle_tokens(1)
        assert await _count(redis_proc.url, adm, "t") == 0 and await _count(redis_proc.url, adm, "u") == 0
        assert len(adm.book.leases) == 0
    finally:
        await other.aclose()
        await adm.close()
