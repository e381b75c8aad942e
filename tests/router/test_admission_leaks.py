"""Admission defects of issue 10, each reproduced against a real redis-server of the test's own
(restartable, AOF so leases survive a kill -9 as a production Redis with persistence does).

- a deadline or cancel that hits while acquire is in flight leaked the lease for its TTL;
- a release on a stale pooled connection after a Redis restart was swallowed unlogged;
- one Redis connection per concurrent request;
- a stalled event loop turned a healthy Redis into REDIS_UNAVAILABLE;
- a heartbeat task per request.
"""

from __future__ import annotations

import asyncio
import pathlib
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator

import pytest
import redis.asyncio as aioredis
import structlog.testing

from router_svc.admission import Admission, AdmissionSettings, LeaseKeeper
from services.errors import ResourceExhausted
from tests.waiting import poll


class RedisProc:
    """redis-server on a unix socket that a test may kill -9 and start again on the same socket."""

    def __init__(self, tmp: pathlib.Path) -> None:
        self.dir = tmp
        self.sock = tmp / "redis.sock"
        self.url = f"unix://{self.sock}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        server = shutil.which("redis-server")
        if server is None:
            pytest.fail("redis-server is required")
        self.sock.unlink(missing_ok=True)
        self.proc = subprocess.Popen([server, "--port", "0", "--unixsocket", str(self.sock), "--save", "",
                                      "--appendonly", "yes", "--appendfsync", "always", "--dir", str(self.dir)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while not self.sock.exists():
            assert self.proc.poll() is None and time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.01)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)


@pytest.fixture
def redis_proc(tmp_path: pathlib.Path) -> Iterator[RedisProc]:
    r = RedisProc(tmp_path)
    r.start()
    yield r
    if r.proc is not None and r.proc.poll() is None:
        r.proc.terminate()
        r.proc.wait(10)


def _admission(url: str, **kw: object) -> Admission:
    settings: dict[str, object] = {"redis_url": url, "pool": uuid.uuid4().hex, "lease_ttl": 30.0, **kw}
    return Admission(AdmissionSettings(**settings))  # type: ignore[arg-type]


async def _count(url: str, adm: Admission, tenant: str) -> int:
    """Leases held by `tenant`, read on a connection of its own."""
    r = aioredis.from_url(url)
    try:
        return int(await r.zcard(adm._key(tenant)))
    finally:
        await r.aclose()


async def _evalsha_calls(r: aioredis.Redis) -> int:
    stats = await r.info("commandstats")
    return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))


@pytest.mark.parametrize("how", ["deadline", "cancel"])
async def test_lease_granted_after_caller_gave_up_is_released(redis_proc: RedisProc, how: str) -> None:
    adm = _admission(redis_proc.url)
    other = aioredis.from_url(redis_proc.url)
    try:
        await adm.acquire("t", "warm", 5)   # loads the script, so the paused call is the acquire itself
        await adm.release("t", "warm")
        calls = await _evalsha_calls(other)
        await other.execute_command("CLIENT", "PAUSE", 500, "WRITE")   # Redis holds the acquire...
        task = asyncio.ensure_future(adm.acquire("t", "r1", 5))
        if how == "deadline":
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.1):            # ...while the request's deadline passes
                    await task
        else:
            await poll(lambda: adm.redis.connection_pool._in_use_connections, what="acquire sent")
            task.cancel()                                   # ...or the client cancels
            with pytest.raises(asyncio.CancelledError):
                await task
        # Redis runs the acquire when the pause ends and grants the lease to nobody:
        await poll(lambda: _granted(other, calls), timeout=5,
                   what="the paused acquire ran")
        await poll(lambda: _zero(redis_proc.url, adm, "t"), timeout=3, what="the lease released")
    finally:
        await other.aclose()
        await adm.close()


async def _granted(r: aioredis.Redis, calls: int) -> bool:
    return await _evalsha_calls(r) > calls


async def _zero(url: str, adm: Admission, tenant: str) -> bool:
    return await _count(url, adm, tenant) == 0


async def test_release_after_redis_restart_frees_the_slot(redis_proc: RedisProc) -> None:
    adm = _admission(redis_proc.url)
    try:
        # Several pooled connections, each used once, then Redis dies and comes back (AOF: leases kept).
        await asyncio.gather(*(adm.acquire("t", f"r{i}", 100) for i in range(4)))
        assert await _count(redis_proc.url, adm, "t") == 4
        redis_proc.kill()
        redis_proc.start()
        assert await _count(redis_proc.url, adm, "t") == 4
        for i in range(4):   # each release may land on a connection that died with the old server
            await adm.release("t", f"r{i}")
        assert await _count(redis_proc.url, adm, "t") == 0
    finally:
        await adm.close()


async def test_release_while_redis_is_down_is_retried_and_logged(redis_proc: RedisProc) -> None:
    adm = _admission(redis_proc.url, op_timeout=0.5, heartbeat_interval=0.1)
    try:
        await adm.acquire("t", "r1", 5)
        redis_proc.kill()
        with structlog.testing.capture_logs() as logs:
            await adm.release("t", "r1")           # fails: logged, and kept for the heartbeat loop
        assert [e["event"] for e in logs] == ["lease_release_failed"]
        assert adm.leases.pending_releases == 1
        redis_proc.start()
        await poll(lambda: _zero(redis_proc.url, adm, "t"), timeout=5, what="the retried release")
        await poll(lambda: adm.leases.pending_releases == 0, what="nothing left to retry")
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
        await adm.acquire("t", "warm", 5)
        loop = asyncio.get_running_loop()
        task = asyncio.ensure_future(adm.acquire("t", "r1", 5))
        loop.call_soon(time.sleep, 0.8)             # one stall while Redis answers at once
        assert await task == 2
        # A busy loop: each iteration takes 0.15 s, so an operation's few iterations outlast
        # op_timeout (0.2 s) although Redis answers in microseconds.
        loop.call_soon(_hog, loop, time.monotonic() + 1.5, 0.15)
        results = await asyncio.gather(*(adm.acquire("t", f"b{i}", 50) for i in range(10)),
                                       adm.release("t", "r1"), return_exceptions=True)
        assert [r for r in results if isinstance(r, BaseException)] == []
        assert await _count(redis_proc.url, adm, "t") == 11
        assert getattr(getattr(adm, "leases", None), "pending_releases", 0) == 0
    finally:
        await adm.close()


async def test_redis_that_does_not_answer_is_still_unavailable(redis_proc: RedisProc) -> None:
    adm = _admission(redis_proc.url, op_timeout=0.3)
    try:
        await adm.acquire("t", "warm", 5)
        assert redis_proc.proc is not None
        redis_proc.proc.send_signal(signal.SIGSTOP)      # a hung Redis, on a loop that is on time
        try:
            t0 = time.monotonic()
            with pytest.raises(Exception) as e:
                await adm.acquire("t", "r1", 5)
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
        await asyncio.gather(*(adm.acquire("t", f"r{i}", 1000) for i in range(200)))
        clients = await other.client_list()
        assert len(clients) <= 4 + 1, len(clients)       # the pool's and this one
        assert await _count(redis_proc.url, adm, "t") == 200
    finally:
        await other.aclose()
        await adm.close()


async def test_one_heartbeat_task_and_call_for_all_leases(redis_proc: RedisProc) -> None:
    adm = _admission(redis_proc.url, lease_ttl=0.5, heartbeat_interval=0.1)
    other = aioredis.from_url(redis_proc.url)
    try:
        for i in range(50):
            await adm.acquire("t" if i % 2 else "u", f"r{i}", 25)
        before = len(asyncio.all_tasks())
        keepers = [LeaseKeeper(adm, "t" if i % 2 else "u", f"r{i}") for i in range(50)]
        for k in keepers:
            await k.__aenter__()
        assert len(asyncio.all_tasks()) == before + 1      # one task for all 50 leases
        calls = await _evalsha_calls(other)
        await asyncio.sleep(1.2)                           # > 2 TTLs: only heartbeats keep them
        ticks = await _evalsha_calls(other) - calls
        assert 3 <= ticks <= 15, ticks                     # one call per tick, not one per lease
        with pytest.raises(ResourceExhausted):
            await adm.acquire("t", "extra", 25)
        for k in keepers:
            await k.__aexit__(None, None, None)
        assert await _count(redis_proc.url, adm, "t") == 0 and await _count(redis_proc.url, adm, "u") == 0
        assert len(adm.leases) == 0
    finally:
        await other.aclose()
        await adm.close()


async def test_the_core_admission_adapter_uses_the_one_heartbeat_task(redis_proc: RedisProc) -> None:
    from router_svc.adapters import LeaseAdmission
    from router_svc.types import Usage

    adm = _admission(redis_proc.url, lease_ttl=0.5, heartbeat_interval=0.1)
    try:
        port = LeaseAdmission(adm)
        grants = [await port.admit("t", f"r{i}", 10, 1) for i in range(5)]
        assert len(adm.leases) == 5
        tasks = [t for t in asyncio.all_tasks() if t.get_name() == "lease-heartbeats"]
        assert len(tasks) == 1
        with pytest.raises(ResourceExhausted):
            await port.admit("t", "r9", 5, 1)
        for g in grants:
            await g.settle(Usage())
        assert len(adm.leases) == 0 and await _count(redis_proc.url, adm, "t") == 0
    finally:
        await adm.close()
