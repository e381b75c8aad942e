"""The router's Redis clients against a real 3-master Redis Cluster (``redis+cluster://``): admission
pools whose hash tags land on different masters, two router-side `RedisCluster` members (request
ids, Cancel through the owner's channel, a dead owner's id taken over, a live one's not),
placement sharing, the engines' registry and the traffic split's notices. Every key of a pool
carries its hash tag, so each call maps to one slot."""

from __future__ import annotations

import asyncio
import pathlib
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis
from redis.crc import key_slot

from engine_svc.registration import Registration
from router_svc.admission import Admission
from router_svc.cluster import RedisCluster
from router_svc.cluster_redis import Pipeliner, open_redis
from router_svc.discovery import RegistrySource
from router_svc.placement_share import PlacementShare
from router_svc.pools import SplitConfig, SplitStore, reset_split, write_split
from router_svc.prefix_index import PrefixIndex
from services.errors import ResourceExhausted, TokenrelayError
from tests.router.admission_kit import req, settings
from tests.waiting import poll


def _node(port: int, command: str) -> Any:
    with redis.Redis(port=port, socket_timeout=2) as node:
        return node.execute_command(command)


class Cluster:
    """Three redis-server masters in cluster mode on free loopback ports (and their bus ports)."""

    def __init__(self, tmp: pathlib.Path) -> None:
        self.tmp = tmp
        self.ports: list[int] = []
        self.procs: list[subprocess.Popen[bytes]] = []
        self.slots: list[tuple[int, int, int]] = []    # (first slot, last slot, port)

    @staticmethod
    def _free_port() -> int:
        while True:       # the port and its cluster bus port (+10000) must both be free
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            if port >= 55535:
                continue
            try:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port + 10000))
                return port
            except OSError:
                continue

    def start(self) -> None:
        server = shutil.which("redis-server") or "redis-server"
        for _ in range(3):
            port = self._free_port()
            node = self.tmp / str(port)
            node.mkdir()
            self.procs.append(subprocess.Popen(
                [server, "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
                 "--cluster-config-file", f"nodes-{port}.conf", "--dir", str(node), "--save", "",
                 "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            self.ports.append(port)
        for port in self.ports:
            self._wait(lambda p=port: _node(p, "PING"))
        subprocess.run(["redis-cli", "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports),
                        "--cluster-replicas", "0", "--cluster-yes"], check=True, capture_output=True, timeout=30)
        for port in self.ports:
            self._wait(lambda p=port: _node(p, "CLUSTER INFO").get("cluster_state") == "ok")
        self.slots = [(int(first), int(last), int(master[1]))
                      for first, last, master, *_ in _node(self.ports[0], "CLUSTER SLOTS")]

    @staticmethod
    def _wait(check) -> None:
        deadline = time.monotonic() + 15
        while True:
            try:
                if check():
                    return
            except redis.RedisError:
                pass
            assert time.monotonic() < deadline, "redis cluster did not come up"
            time.sleep(0.05)

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.ports[0]}"

    def port_of(self, pool: str) -> int:
        slot = key_slot(f"{{{pool}}}".encode())
        return next(port for first, last, port in self.slots if first <= slot <= last)

    def pools(self) -> dict[int, str]:
        """One pool name per master: its hash tag's slot is served there."""
        found: dict[int, str] = {}
        while len(found) < len(self.ports):
            pool = uuid.uuid4().hex[:12]
            found.setdefault(self.port_of(pool), pool)
        return found

    def stop(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait(10)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    if shutil.which("redis-cli") is None:
        pytest.skip("redis-cli is missing: it creates the test's Redis Cluster")
    c = Cluster(tmp_path_factory.mktemp("redis-cluster"))
    try:
        c.start()
        yield c
    finally:
        c.stop()


async def _keys_on(port: int, pool: str) -> int:
    node = aioredis.Redis(port=port)
    try:
        return len(await node.keys(f"t[qr]:\\{{{pool}\\}}:*"))
    finally:
        await node.aclose()


async def test_admission_grants_queues_settles_and_refuses_on_two_masters(cluster: Cluster) -> None:
    by_port = cluster.pools()
    (port1, pool1), (port2, pool2) = list(by_port.items())[:2]
    for port, pool in ((port1, pool1), (port2, pool2)):
        # Two router processes on one pool: `waiter` learns of its grant on its channel (pub/sub), not
        # from a heartbeat (queue_poll 3 s, far beyond the 1 s allowed below).
        cfg = settings(cluster.url, pool=pool, queue_poll=3.0, lease_ttl=10.0)
        granter, waiter = Admission(cfg, "granter"), Admission(cfg, "waiter")
        assert type(granter.redis).__name__ == "RedisCluster"
        try:
            await granter.start()
            await waiter.start()
            await asyncio.wait_for(waiter.book.listening.wait(), 2)
            first, second = await granter.admit(req("t", "1")), await granter.admit(req("t", "2"))
            assert first.grant is not None and second.grant is not None
            queued = await waiter.admit(req("t", "3"))
            later = await waiter.admit(req("t", "4"))
            assert (queued.grant, queued.position, later.position) == (None, 1, 2)
            with pytest.raises(ResourceExhausted) as e:
                await granter.admit(req("t", "5", max_in_flight=2, max_queued=2))
            assert e.value.reason == "TENANT_QUEUE_FULL" and e.value.retry_after
            assert await granter.in_flight("t") == 2
            t0 = time.monotonic()
            await first.grant.settle_tokens(100)            # dispatches `queued`, owned by the other router
            await asyncio.wait_for(queued.next(), 1.0)
            assert queued.grant is not None and time.monotonic() - t0 < 1.0
            later.cancel()                                   # cancelled while queued: out at once
            with pytest.raises(TokenrelayError) as c:
                await later.next()
            assert c.value.reason == "CANCELLED"
            await later.abandon()
            assert (await granter.depths())["standard"] == 0
            # The pool's keys live on the master of its hash tag's slot, and only there.
            assert await _keys_on(port, pool) > 0
            assert [await _keys_on(p, pool) for p in cluster.ports if p != port] == [0, 0]
            for grant in (second.grant, queued.grant):
                await grant.settle_tokens(10)
            assert await granter.in_flight("t") == 0
        finally:
            await granter.close()
            await waiter.close()


async def test_router_members_share_request_ids_and_cancel_on_every_master(cluster: Cluster) -> None:
    # Pools on all three masters: redis-py's default node (where it sends keyless commands such as
    # PUBSUB NUMSUB) differs from at least two of them, where a live owner must still count as alive.
    for pool in cluster.pools().values():
        await _two_members_on(cluster.url, pool)


async def _two_members_on(url: str, pool: str) -> None:
    a = RedisCluster(url, pool, router_id="a", op_timeout=0.5, cancel_timeout=0.5)
    b = RedisCluster(url, pool, router_id="b", op_timeout=0.5, cancel_timeout=0.5)
    await a.start()
    await b.start()
    try:
        assert await a.registry.claim("t1", "r")
        assert not await b.registry.claim("t1", "r")       # held by a live router
        assert await b.registry.claim("t2", "r")           # another tenant's id
        hits: list[str] = []
        a.registry.on_cancel("t1", "r", lambda: hits.append("r"))
        assert await b.registry.cancel("t1", "r") is True  # through a's channel
        assert hits == ["r"]
        assert await b.registry.cancel("t1", "never-sent") is False
        await a.registry.release("t1", "r")
        assert await b.registry.claim("t1", "r")           # free everywhere once released
        # A dead router's id is taken over at once; a live router's (b holds it) is not.
        await a.redis.set(a.key("rid", "t", "orphan"), "crashed-router", px=30_000)
        assert await a.registry.claim("t", "orphan")
        assert not await b.registry.claim("t", "orphan")
        await b.sessions.set("t", "s", "e1:1")
        assert await poll(lambda: a.sessions.get("t", "s"), timeout=2) == "e1:1"   # b's SET is not awaited
        await a.heartbeat_once()                            # one script call over the pool's keys
    finally:
        await a.close()
        await b.close()


async def test_placements_are_shared_through_the_cluster(cluster: Cluster) -> None:
    prompt = list(range(1, 200))
    shares = []
    indexes = [PrefixIndex(tokens_per_block=16), PrefixIndex(tokens_per_block=16)]
    pool = next(iter(cluster.pools().values()))
    for name, index in zip(("ra", "rb"), indexes, strict=True):
        index.reset("e1:1", events=True)
        client = open_redis(cluster.url, 0.5)
        pipe = Pipeliner(client, 0.5)
        pipe.start()
        share = PlacementShare(client, pipe, pool, name, index, dict, op_timeout=0.5, tick=0.02)
        await share.start()
        shares.append((share, pipe, client))
    try:
        indexes[0].placed("e1:1", prompt, "t")
        await poll(lambda: indexes[1].match(prompt, ["e1:1"], "t"), timeout=3, what="rb to hear ra's placement")
    finally:
        for share, pipe, client in shares:
            await share.close()
            await pipe.close()
            await client.aclose()


async def test_engine_registry_and_traffic_split_through_the_cluster(cluster: Cluster) -> None:
    pool = list(cluster.pools().values())[-1]
    reg = Registration(cluster.url, pool, "10.0.0.1:1", lambda: {"pool": "default"}, heartbeat=0.05, ttl=1.0)
    source = RegistrySource(cluster.url, pool, interval=0.05)
    base = SplitConfig.build("default=100")
    store = SplitStore(base, cluster.url, pool, poll_interval=30.0)
    admin = open_redis(cluster.url, 1.0)
    try:
        await reg.start()
        reading = await source.read()
        assert reading is not None and set(reading.members) == {"10.0.0.1:1"}
        await store.start()
        assert await write_split(admin, pool, {"default": 90, "canary": 10}, who="test") == 1
        # The pub/sub notice, not the 30 s poll, brings it.
        await poll(lambda: store.config.version == 1, timeout=3, what="the split notice")
        await reset_split(admin, pool)            # a MULTI of the split key and its channel: one slot
        await poll(lambda: store.config == base, timeout=3, what="the reset")
        await reg.close()                          # a clean stop deletes the entry
        gone = await source.read()
        assert gone is not None and "10.0.0.1:1" not in gone.members
    finally:
        await reg.close()
        await source.close()
        await store.close()
        await admin.aclose()
