"""The engine replica registry with real processes: sim engines that register themselves in a real
redis-server (engine_svc --registry-redis-url) and routers that follow it (--engine-registry).

A router process with no --engines at all finds the registered engines and serves a request; a
router's pool (in the test's process, so its membership can be watched) follows the engines: a
kill -9 drops the engine once its entry's TTL has passed and its traffic goes to the other; the
engine restarted on its port comes back by itself; a draining engine (SIGTERM) gets no new work
while its in-flight request goes on, and leaves once it exits (its entry deleted). One test, so
the processes start once.
"""

from __future__ import annotations

import asyncio
import signal
import time

from router_svc.breaker import BreakerState
from router_svc.discovery import Discovery, RegistrySource
from router_svc.types import Sampling
from router_svc.upstreams import EnginePool
from services.client import Client
from services.mux import StreamBroken
from tests.e2e.prockit import KEYS, SIM, Procs
from tests.meshkit import scrape
from tests.redisproc import RedisProc
from tests.waiting import poll
from tokenrelay_tools.cli.launcher import engine_args_for

TTL = 1.0
BEAT = ["--registry-heartbeat", "0.2", "--registry-ttl", str(TTL)]


def _engine(p: Procs, name: str, *extra: str, port: int = 0) -> None:
    p.spawn(name, "engine_svc", "--backend", "sim", "--model", str(p.model), *engine_args_for(p.model, "sim"), *SIM,
            "--registry-redis-url", p.redis_url, "--registry-pool", p.pool, *BEAT, *extra, port=port)


async def test_registered_engines_are_found_dropped_after_kill_back_after_restart_and_drained(
        tmp_path, redis_proc: RedisProc) -> None:
    p = Procs(tmp_path, redis_proc.url)
    pool = EnginePool(poll_interval=0.2, poll_timeout=1.0)
    discovery = Discovery([RegistrySource(redis_proc.url, p.pool, interval=0.1)], pool)
    try:
        p.spawn("tok", "tokenizer_svc", "--tokenizer", str(p.model))
        _engine(p, "e0")
        _engine(p, "e1", "--shutdown-grace", "3")   # a KV-event subscriber may hold it that long
        await p.ready("tok", "e0", "e1")
        e0, e1 = p.addr["e0"], p.addr["e1"]
        # A router process with no --engines at all: it finds both in the registry and serves.
        p.spawn("router", "router_svc", "--tokenizers", p.addr["tok"], "--engine-registry", "--registry-interval",
                "0.2", "--redis-url", p.redis_url, "--pool", p.pool, "--tenants-file", str(p.tenants),
                "--engine-poll-interval", "0.2")
        await discovery.start()
        await pool.start()
        await poll(lambda: sorted(pool.addresses()) == sorted([e0, e1]), timeout=10, what="both engines")
        assert await _served(pool, e0) and await _served(pool, e1)
        await p.ready("router")
        async with Client(p.addr["router"], KEYS["t1"]) as client:
            result = await client.generate("hello", max_tokens=4, ignore_eos=True)
        assert result.finished.completion_tokens == 4, p.log("router")
        ready = ("tokenrelay_router_engine_replicas", frozenset({("pool", "default"), ("state", "ready")}))
        assert scrape(p.metrics["router"])[ready] == 2

        # kill -9: no goodbye; the entry expires after its TTL and the replica leaves the pool.
        p.procs["e0"].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        await poll(lambda: e0 not in pool.addresses(), timeout=10, what="e0 to leave")
        assert time.monotonic() - killed < TTL + 3, "removed far later than its TTL"
        for _ in range(3):
            assert pool.pick().address == e1 and await _served(pool, e1)

        # Restarted on its port: back by itself.
        _engine(p, "e0", port=int(e0.rsplit(":", 1)[1]))
        await p.ready("e0")
        await poll(lambda: e0 in pool.addresses() and pool.replica(e0).healthy, timeout=10, what="e0 back")
        assert await _served(pool, e0)

        # Draining: no new work, the in-flight request goes on; gone once it exits.
        inbox = pool.submit(e1, "long", [1, 2, 3], Sampling(max_tokens=4000, ignore_eos=True), [], "", {})
        assert not isinstance(await asyncio.wait_for(inbox.get(), 10), StreamBroken)
        r1 = pool.replica(e1)
        p.procs["e1"].send_signal(signal.SIGTERM)
        await poll(lambda: not r1.serving, timeout=5, what="e1 draining")
        snap = {s.address: s for s in pool.snapshots()}[e1]
        assert snap.healthy and not snap.serving       # out of rotation, not counted as failing
        assert pool.replica(e1).breaker.clean()
        for _ in range(5):
            assert pool.pick().address == e0
        got = await asyncio.wait_for(inbox.get_ready(), 10)
        assert got and not any(isinstance(c, StreamBroken) for c in got)
        pool.abort(e1, "long")
        pool.release(e1, "long")
        await asyncio.to_thread(p.procs["e1"].wait, 30)
        await poll(lambda: e1 not in pool.addresses(), timeout=5, what="e1 to leave after its exit")
        assert pool.addresses() == [e0]
        # Its polls failed between the end of its drain and its entry's deletion: not counted.
        assert r1.breaker.state is BreakerState.CLOSED and r1.breaker.consecutive == 0
    finally:
        await discovery.close()
        await pool.close()
        p.stop()


async def _served(pool: EnginePool, address: str, rid: list[int] = [0]) -> bool:   # noqa: B006 - a counter
    rid[0] += 1
    request_id = f"r{rid[0]}"
    inbox = pool.submit(address, request_id, [1, 2, 3], Sampling(max_tokens=3, ignore_eos=True), [], "", {})
    try:
        while True:
            chunk = await asyncio.wait_for(inbox.get(), 10)
            if isinstance(chunk, StreamBroken) or chunk.error_reason:
                return False
            if chunk.finished:
                return True
    finally:
        pool.release(address, request_id)
