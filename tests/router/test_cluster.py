"""router_svc/cluster.py against a real redis-server: request ids scoped by tenant and unique across
router processes (two `RedisCluster` members stand for two processes here; tests/e2e/test_scaleout.py
runs real ones), Cancel through the owner's channel, session affinity, one heartbeat task, and
Redis down or stopped: local answers within the bound, never a hang."""

from __future__ import annotations

import asyncio
import os
import pathlib
import shutil
import signal
import subprocess
import time
import uuid

import pytest
import redis.asyncio as aioredis

from router_svc.cluster import RedisCluster
from services.errors import Reason, Unavailable
from services.redis_client import unix_socket_listening
from tests.waiting import poll


def _member(url: str, pool: str, **kw) -> RedisCluster:
    kw.setdefault("op_timeout", 0.3)
    kw.setdefault("cancel_timeout", 0.5)
    return RedisCluster(url, pool, **kw)


@pytest.fixture
async def pair(redis_url):
    pool = uuid.uuid4().hex
    a, b = _member(redis_url, pool, router_id="a"), _member(redis_url, pool, router_id="b")
    await a.start()
    await b.start()
    yield a, b
    await a.close()
    await b.close()


class PrivateRedis:
    """A redis-server of one test, to stop, kill and restart."""

    def __init__(self, tmp: pathlib.Path) -> None:
        self.sock = tmp / "r.sock"
        self.tmp = tmp
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"unix://{self.sock}"

    def start(self) -> None:
        self.sock.unlink(missing_ok=True)
        self.proc = subprocess.Popen([shutil.which("redis-server") or "redis-server", "--port", "0", "--unixsocket",
                                      str(self.sock), "--save", "", "--appendonly", "no", "--dir", str(self.tmp)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while not unix_socket_listening(self.sock):
            assert self.proc.poll() is None and time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.01)

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, sig)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def private_redis(tmp_path):
    r = PrivateRedis(tmp_path)
    r.start()
    yield r
    r.stop()


async def test_request_ids_are_scoped_by_tenant_and_unique_across_routers(pair):
    a, b = pair
    assert await a.registry.claim("t1", "r")
    assert not await a.registry.claim("t1", "r")      # same process
    assert not await b.registry.claim("t1", "r")      # another router process
    assert await b.registry.claim("t2", "r")          # another tenant: independent, never blocked
    await a.registry.release("t1", "r")
    assert await b.registry.claim("t1", "r")          # free on every router once release returns


async def test_an_id_released_without_waiting_is_free_on_every_router_at_once(pair):
    # A refused or failed request releases its id without waiting for Redis (its status goes out
    # first): the same id sent again at once, to another router, runs; the late delete of the old
    # claim does not free the new one.
    a, b = pair
    for i in range(20):
        assert await a.registry.claim("t", f"r{i}")
        await a.registry.release("t", f"r{i}", wait=False)
        assert await b.registry.claim("t", f"r{i}")
        assert not await a.registry.claim("t", f"r{i}")   # b holds it now, even after a's delete landed
        await b.registry.release("t", f"r{i}")


async def test_concurrent_claims_of_one_id_admit_exactly_one(pair):
    a, b = pair
    results = await asyncio.gather(*(m.registry.claim("t", "same") for m in (a, b) * 8))
    assert sum(results) == 1


async def test_cancel_reaches_the_router_holding_the_request(pair):
    a, b = pair
    hits: list[str] = []
    assert await a.registry.claim("t", "r1")
    a.registry.on_cancel("t", "r1", lambda: hits.append("r1"))
    assert await b.registry.cancel("t", "r1") is True
    assert hits == ["r1"]
    # Another tenant's id reads exactly like an unknown one, and cancels nothing.
    assert await b.registry.cancel("intruder", "r1") is False
    assert await a.registry.cancel("intruder", "r1") is False
    assert await b.registry.cancel("t", "never-sent") is False
    assert hits == ["r1"]


async def test_a_cancel_its_owner_does_not_answer_in_time_is_refused_as_retryable(pair):
    a, b = pair
    assert await a.registry.claim("t", "busy")
    a.registry.remote_cancel = lambda message: None   # subscribed, but (stopped, stalled) answers nothing
    t0 = time.monotonic()
    with pytest.raises(Unavailable) as refused:
        await b.registry.cancel("t", "busy")
    assert refused.value.reason == Reason.CANCEL_NOT_CONFIRMED and refused.value.retry_after
    assert time.monotonic() - t0 < b.registry.cancel_timeout + 1


async def test_cancel_of_an_id_whose_owner_died_is_false_at_once(pair, redis_url):
    a, b = pair
    # A router that died holding an id: its key lives until the TTL, nobody listens on its channel.
    r = aioredis.from_url(redis_url)
    await r.set(a.key("rid", "t", "orphan"), "dead-router", px=10_000)
    await r.aclose()
    t0 = time.monotonic()
    assert await b.registry.cancel("t", "orphan") is False
    assert time.monotonic() - t0 < b.registry.cancel_timeout  # PUBLISH reached nobody: no wait


async def test_an_id_held_by_a_dead_router_is_taken_over_at_once(pair, redis_url):
    a, b = pair
    r = aioredis.from_url(redis_url)
    await r.set(a.key("rid", "t", "retry-me"), "crashed-router", px=30_000)
    assert await b.registry.claim("t", "retry-me")              # nobody listens for crashed-router
    assert await r.get(a.key("rid", "t", "retry-me")) == b"b"
    assert not await a.registry.claim("t", "retry-me")          # b is alive: a real duplicate
    await r.aclose()


async def test_a_stale_claim_of_a_live_router_that_no_longer_holds_the_id_does_not_block_it(pair, redis_url):
    """A release lost in a Redis crash (an AOF replayed without its last second: the claim is back,
    the delete is not) leaves a live router's id in Redis that it no longer holds. A retry of that id
    must run, not get DUPLICATE_REQUEST_ID until the key expires; an id the owner does hold stays refused."""
    a, b = pair
    assert await a.registry.claim("t", "lost-release")
    await a.registry.release("t", "lost-release")
    r = aioredis.from_url(redis_url)
    try:
        await r.set(a.key("rid", "t", "lost-release"), "a", px=15_000)   # what the replayed AOF brought back
        assert await b.registry.claim("t", "lost-release")                # a holds nothing: b takes it
        assert (await r.get(a.key("rid", "t", "lost-release"))) == b"b"
        assert await a.registry.claim("t", "held")
        assert not await b.registry.claim("t", "held")                    # really held by a: refused
    finally:
        await r.aclose()


async def test_one_heartbeat_task_keeps_every_id_and_reclaims_after_a_restart(pair, redis_url):
    a, _ = pair
    for i in range(1200):  # more than one Lua chunk
        assert await a.registry.claim("t", f"id{i}")
    beats = [t for t in asyncio.all_tasks() if t.get_name() == "cluster-request-id-heartbeat"]
    assert len(beats) == 2  # one per member (process), however many ids
    r = aioredis.from_url(redis_url)
    key = a.key("rid", "t", "id1100")
    await r.pexpire(key, 50)
    await a.heartbeat_once()
    assert await r.pttl(key) > 10_000
    await r.delete(key, a.key("rid", "t", "id3"))  # what a Redis restart loses
    await a.heartbeat_once()
    assert await r.get(key) == b"a" and await r.get(a.key("rid", "t", "id3")) == b"a"
    await r.aclose()


async def test_sessions_stick_across_routers(pair, redis_url):
    a, b = pair
    assert await b.sessions.get("t", "s1") == ""
    await a.sessions.set("t", "s1", "engine-2:1")
    assert await poll(lambda: b.sessions.get("t", "s1"), timeout=5) == "engine-2:1"
    assert await b.sessions.get("other", "s1") == ""  # scoped by tenant
    long_id = "x" * 5000
    await a.sessions.set("t", long_id, "engine-1:1")
    assert await poll(lambda: b.sessions.get("t", long_id), timeout=5) == "engine-1:1"
    r = aioredis.from_url(redis_url)
    assert all(len(k) < 200 for k in await r.keys(f"tr:{{{a.pool}}}:sess:*"))  # long ids are hashed
    await r.aclose()


async def test_redis_unreachable_falls_back_to_local_without_hanging(tmp_path):
    m = _member(f"unix://{tmp_path}/nothing.sock", "p", op_timeout=0.2)
    t0 = time.monotonic()
    await m.start()
    assert await m.registry.claim("t", "r")
    assert not await m.registry.claim("t", "r")  # still unique within this process
    hits: list[int] = []
    m.registry.on_cancel("t", "r", lambda: hits.append(1))
    assert await m.registry.cancel("t", "r") and hits == [1]
    # An id this process does not hold may run on another router, which only Redis can reach:
    # "not in flight" would be a guess, so the Cancel is refused as retryable (probe_mix found the
    # guess: a Cancel answered false during a Redis restart while its request kept streaming).
    with pytest.raises(Unavailable) as refused:
        await m.registry.cancel("t", "elsewhere")
    assert refused.value.reason == Reason.REDIS_UNAVAILABLE
    await m.sessions.set("t", "s", "e:1")
    assert await m.sessions.get("t", "s") == "e:1"
    await m.registry.release("t", "r")
    await m.close()
    assert time.monotonic() - t0 < 5


async def test_a_stopped_redis_costs_each_operation_its_bound_and_releases_land_later(private_redis):
    m = _member(private_redis.url, "p", op_timeout=0.3)
    await m.start()
    assert await m.registry.claim("t", "r")
    private_redis.signal(signal.SIGSTOP)  # accepts nothing, answers nothing
    try:
        t0 = time.monotonic()
        assert await m.registry.claim("t", "r2")  # local answer
        with pytest.raises(Unavailable):          # not a guess that it is not in flight
            await m.registry.cancel("t", "remote")
        assert time.monotonic() - t0 < 2.5
        await m.registry.release("t", "r")         # cannot reach Redis now ...
        await poll(lambda: m.registry.unreleased(), timeout=5, what="the failed release to be kept")
    finally:
        private_redis.signal(signal.SIGCONT)
    await poll(lambda: _heartbeat_ok(m), timeout=10, what="a heartbeat after Redis resumed")
    r = aioredis.from_url(private_redis.url)
    assert await r.get(m.key("rid", "t", "r")) is None          # ... and is released after it resumed
    assert await r.get(m.key("rid", "t", "r2")) == m.router_id.encode()  # the local claim reached Redis
    await r.aclose()
    await m.close()


async def _heartbeat_ok(m: RedisCluster) -> bool:
    try:
        await m.heartbeat_once()
    except Exception:  # noqa: BLE001 - Redis still waking up
        return False
    return not m.registry.unreleased()


async def test_restarted_redis_serves_again_on_fresh_connections(private_redis):
    m = _member(private_redis.url, "p", op_timeout=0.5)
    await m.start()
    assert await m.registry.claim("t", "before")
    private_redis.stop()
    private_redis.start()  # every pooled connection is now stale
    assert await m.registry.claim("t", "after")
    r = aioredis.from_url(private_redis.url)
    assert await r.get(m.key("rid", "t", "after")) == m.router_id.encode()
    await m.heartbeat_once()  # and the id the restart lost is claimed again
    assert await r.get(m.key("rid", "t", "before")) == m.router_id.encode()
    # the Cancel channel resubscribes: a remote cancel reaches this member again
    other = _member(private_redis.url, "p", router_id="other")
    await other.start()
    hits: list[int] = []
    m.registry.on_cancel("t", "after", lambda: hits.append(1))
    assert await poll(lambda: other.registry.cancel("t", "after"), timeout=10, what="resubscribed") is True
    await other.close()
    await r.aclose()
    await m.close()


async def test_a_claim_that_follows_a_release_of_its_id_in_one_batch_keeps_the_id(pair, redis_url):
    # One pipeline batch carries a release of id x and then a new claim of x by the same router (a
    # refused request's id, released without waiting, sent again at once), after a claim of another
    # id. The batch groups claims into one script call: the group of claims went before the release,
    # which then deleted the new claim, so x ran here unclaimed in Redis and another router's
    # duplicate of it ran too. Submission order is kept per key.
    a, b = pair
    assert await a.registry.claim("t", "x")
    z = asyncio.ensure_future(a.registry.claim("t", "z"))
    freed = asyncio.ensure_future(a.registry.release("t", "x", wait=False))
    again = asyncio.ensure_future(a.registry.claim("t", "x"))
    assert await z and await again
    await freed
    r = aioredis.from_url(redis_url)
    try:
        assert await r.get(a.key("rid", "t", "x")) == b"a"
    finally:
        await r.aclose()
    assert not await b.registry.claim("t", "x")        # a runs it: another router's duplicate is refused


async def test_a_cancel_while_the_claim_is_in_flight_reaches_the_request(pair):
    # The id is held here from the claim's first step, but the request registers its cancel
    # callback only once the claim is answered: a Cancel in between answered `cancelled` and
    # reached nothing, and the request ran to its end.
    a, _ = pair
    claiming = asyncio.ensure_future(a.registry.claim("t", "c"))
    await asyncio.sleep(0)                                  # the claim is on its way to Redis
    assert await a.registry.cancel("t", "c")
    assert await claiming
    called: list[str] = []
    a.registry.on_cancel("t", "c", lambda: called.append("stage"))
    assert called == ["stage"]                              # told at once: it was cancelled
    await a.registry.release("t", "c")
    assert await a.registry.claim("t", "c")                 # the id again: a new request, not cancelled
    a.registry.on_cancel("t", "c", lambda: called.append("again"))
    assert called == ["stage"]
    await a.registry.release("t", "c")


async def test_a_cancel_while_a_duplicate_claims_reaches_the_router_running_the_id(pair):
    # b runs the id; a duplicate of it is being claimed on a. A Cancel on a must not stop at a's
    # tentative entry (a's request will be refused): it reaches b's.
    a, b = pair
    assert await b.registry.claim("t", "d")
    cancelled: list[bool] = []
    b.registry.on_cancel("t", "d", lambda: cancelled.append(True))
    claiming = asyncio.ensure_future(a.registry.claim("t", "d"))
    await asyncio.sleep(0)
    assert await a.registry.cancel("t", "d")
    assert not await claiming
    assert cancelled == [True]
    await b.registry.release("t", "d")


async def test_the_heartbeat_leaves_claims_in_flight_alone(pair):
    # A claim still being decided (here: a duplicate of an id b holds) is not an id this router
    # holds in Redis: the heartbeat counted it as "lost" to another router (a warning meant for
    # duplicates admitted while Redis was unreachable).
    a, b = pair
    assert await b.registry.claim("t", "h")
    claiming = asyncio.ensure_future(a.registry.claim("t", "h"))
    await asyncio.sleep(0)
    assert await a.heartbeat_once() == 0
    assert not await claiming
    await b.registry.release("t", "h")
