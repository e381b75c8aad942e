"""The admission queue through real router processes sharing one Redis (issue 11).

- a queued request sees its position in repeated `accepted` messages, and a Cancel sent to the
  *other* router removes it from the queue at once;
- nothing lost, proven with a ledger: under load, kill -9 of a router, a router stopped past its
  lease (SIGSTOP), kill -9 of Redis (AOF) and restart, SCRIPT FLUSH and FUNCTION FLUSH, Redis at
  maxmemory, every accepted request ends in exactly one terminal state its client sees (its `done`, or a typed
  status), none hangs, and once leases expire no capacity is left held. A positive control (a
  router stopped for good) must show loss, to prove the checker catches it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import signal
import time
from collections import Counter
from dataclasses import dataclass

import grpc
import pytest
import redis.asyncio as aioredis

from services.channels import CHANNEL_OPTIONS, open_channel
from services.proto.tokenrelay.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from tests.e2e.ledger import Stream, follow
from tests.e2e.prockit import Procs
from tests.redisproc import RedisProc
from tests.waiting import poll

KEY = "ledger-key-" + "c" * 16
TENANTS = ("tenants:\n  - name: t1\n    api_key_sha256: " + hashlib.sha256(KEY.encode()).hexdigest()
           + "\n    max_in_flight: 64\n    max_queued: 256\n")
METADATA = (("authorization", f"Bearer {KEY}"),)
# Routers: short leases so a dead router's capacity returns within the test; the engine runs 4
# requests at once, so the queue in Redis does the waiting.
ROUTER = ["--lease-ttl", "2", "--lease-heartbeat", "0.4", "--queue-poll", "0.3", "--reap-interval", "0.1",
          "--redis-timeout", "0.5"]
ENGINE = ["--sim-max-batch-size", "4"]
CLIENT_TIMEOUT = 30.0     # far beyond any request's own work: reaching it is a hang, i.e. loss


@dataclass
class Outcome(Stream):
    router: str = ""


class Ledger:
    def __init__(self, timeout: float = CLIENT_TIMEOUT) -> None:
        self.outcomes: dict[str, Outcome] = {}
        self.timeout = timeout

    async def one(self, stub: inference_pb2_grpc.InferenceStub, router: str, request_id: str,
                  max_tokens: int = 12) -> None:
        out = self.outcomes.setdefault(request_id, Outcome(router=router))
        call = stub.Generate(inference_pb2.GenerateRequest(
            prompt="ledger", request_id=request_id,
            sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True)),
            metadata=METADATA, timeout=self.timeout)
        await follow(call, out)

    def lost(self) -> list[tuple[str, Outcome]]:
        """Accepted requests without exactly one terminal state, and any request that hung until the
        client gave up (accepted or not: a hang is never an answer)."""
        return [(rid, o) for rid, o in self.outcomes.items()
                if (o.accepted and len(o.terminals) != 1) or o.hung()]

    def summary(self) -> Counter[str]:
        return Counter(t.split("/")[-1] if t != "done" else t for o in self.outcomes.values() for t in o.terminals)


async def _load(ledger: Ledger, p: Procs, routers: list[str], stop: asyncio.Event, clients: int = 12) -> None:
    """Closed-loop clients spread over `routers` (at each one's current address: a restarted router
    has a new port); a client whose router is down retries every 50 ms."""
    ids = itertools.count()
    channels: dict[str, grpc.aio.Channel] = {}

    def stub(router: str) -> inference_pb2_grpc.InferenceStub:
        address = p.addr[router]
        if address not in channels:
            channels[address] = open_channel(address, options=[*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)])
        return inference_pb2_grpc.InferenceStub(channels[address])

    async def client(i: int) -> None:
        router = routers[i % len(routers)]
        while not stop.is_set():
            rid = f"r{next(ids)}"
            await ledger.one(stub(router), router, rid)
            if not ledger.outcomes[rid].accepted:
                await asyncio.sleep(0.05)
    try:
        await asyncio.gather(*(client(i) for i in range(clients)))
    finally:
        for c in channels.values():
            await c.close()


async def _pool_state(url: str, pool: str) -> tuple[int, int]:
    r = aioredis.from_url(url)
    try:
        p = f"tq:{{{pool}}}:"
        queued = sum([int(await r.zcard(p + f"cq:{c}")) for c in ("interactive", "standard", "batch")])
        return int(await r.zcard(p + "leases")), queued
    finally:
        await r.aclose()


async def _drained(url: str, pool: str) -> bool:
    try:
        return await _pool_state(url, pool) == (0, 0)
    except Exception:  # noqa: BLE001 - Redis restarting
        return False


@pytest.fixture
async def mesh(tmp_path):
    redis = RedisProc(tmp_path, appendonly=True, fsync="everysec")
    redis.start()
    p = Procs(tmp_path, redis.url, tenants=TENANTS)
    try:
        await p.upstreams(*ENGINE, engines=1)
        for name in ("ra", "rb"):
            p.router(name, *ROUTER)
        await p.ready("ra", "rb")
        yield p, redis
    finally:
        p.stop()
        if redis.proc is not None and redis.proc.poll() is None:
            redis.kill()


async def test_queue_positions_stream_and_a_cancel_through_the_other_router_removes_it(mesh) -> None:
    p, _redis = mesh
    async with open_channel(p.addr["ra"]) as ca, open_channel(p.addr["rb"]) as cb:
        sa, sb = inference_pb2_grpc.InferenceStub(ca), inference_pb2_grpc.InferenceStub(cb)
        long = [sa.Generate(inference_pb2.GenerateRequest(
            prompt="hold", request_id=f"hold{i}", sampling=common_pb2.SamplingParams(max_tokens=3000, ignore_eos=True)),
            metadata=METADATA, timeout=60) for i in range(4)]           # the engine's 4 slots
        for call in long:
            while (await call.read()).WhichOneof("event") != "delta":
                pass
        queued = sa.Generate(inference_pb2.GenerateRequest(
            prompt="wait", request_id="queued", sampling=common_pb2.SamplingParams(max_tokens=4)),
            metadata=METADATA, timeout=60)
        first = await queued.read()
        assert first.WhichOneof("event") == "accepted" and first.accepted.queue_position == 1
        assert await _pool_state(p.redis_url, p.pool) == (4, 1)
        t0 = time.monotonic()
        answer = await sb.Cancel(inference_pb2.CancelRequest(request_id="queued"), metadata=METADATA, timeout=10)
        assert answer.cancelled
        with pytest.raises(grpc.aio.AioRpcError) as e:
            while (await queued.read()) is not grpc.aio.EOF:
                pass
        assert e.value.code() == grpc.StatusCode.CANCELLED and time.monotonic() - t0 < 2
        assert await _pool_state(p.redis_url, p.pool) == (4, 0)      # out of the queue at once
        for call in long:
            call.cancel()
    await poll(lambda: _drained(p.redis_url, p.pool), timeout=10, what="the held slots given back")


async def test_nothing_is_lost_under_faults_and_no_capacity_leaks(mesh) -> None:
    p, redis = mesh
    ledger, stop = Ledger(), asyncio.Event()
    load = asyncio.ensure_future(_load(ledger, p, ["ra", "rb"], stop))
    try:
        await asyncio.sleep(1.5)
        p.procs["rb"].send_signal(signal.SIGKILL)                 # a router dies mid-load
        await asyncio.sleep(1.0)
        p.router("rb", *ROUTER)                                    # (new clients keep using ra meanwhile)
        await p.ready("rb")
        p.procs["ra"].send_signal(signal.SIGSTOP)                  # a router stalls past its lease (2 s)
        await asyncio.sleep(3.5)
        p.procs["ra"].send_signal(signal.SIGCONT)
        await asyncio.sleep(1.5)
        redis.kill()                                               # Redis dies (AOF everysec) and comes back
        await asyncio.sleep(0.5)
        redis.start()
        await asyncio.sleep(2.0)
        r = aioredis.from_url(redis.url)
        try:
            await r.script_flush()                                 # scripts and the function
            await r.function_flush()                               # library gone: they must reload
            await asyncio.sleep(1.0)
            await r.config_set("maxmemory", "1")                   # Redis full: refused, typed
            await asyncio.sleep(1.0)
            await r.config_set("maxmemory", "0")
        finally:
            await r.aclose()
        await asyncio.sleep(1.5)
    finally:
        stop.set()
        await asyncio.wait_for(load, CLIENT_TIMEOUT + 10)
    summary = ledger.summary()
    print("ledger:", summary)
    assert ledger.lost() == [], (ledger.lost()[:5], summary)
    assert summary["done"] > 100, summary                         # it really ran under load
    # ...and through every fault: a dead router's streams, Redis down, Redis full (all typed).
    assert summary["CONNECTION_LOST"] and summary["REDIS_UNAVAILABLE"] and summary["ADMISSION_STORE_FULL"], summary
    untyped = {k for k in summary if k in ("INTERNAL", "UNKNOWN", "")}
    assert not untyped, summary
    # Every router's leases (the killed one's by expiry) and queue entries are gone: no capacity leaked.
    await poll(lambda: _drained(redis.url, p.pool), timeout=10, what="every lease and queue entry gone")


async def test_positive_control_a_router_stopped_for_good_shows_loss(mesh) -> None:
    p, _redis = mesh
    ledger, stop = Ledger(timeout=4.0), asyncio.Event()
    try:
        load = asyncio.ensure_future(_load(ledger, p, ["ra"], stop, clients=4))
        await poll(lambda: sum(o.terminals == ["done"] for o in ledger.outcomes.values()) > 5, timeout=20,
                   what="load running")
        p.procs["ra"].send_signal(signal.SIGSTOP)      # never continued: its clients' requests hang
        await asyncio.sleep(1.0)
        stop.set()
        await asyncio.wait_for(load, 20)
    finally:
        with contextlib.suppress(ProcessLookupError):
            p.procs["ra"].send_signal(signal.SIGCONT)
    assert ledger.lost(), ledger.summary()             # the checker sees them
