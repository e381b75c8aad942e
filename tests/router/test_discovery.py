"""Where engine replicas come from (router_svc/discovery.py) and how the pool follows them
(router_svc/upstreams.py `EnginePool.add/remove`): entry syntax, a DNS name (``localhost``), the
Redis registry against a real redis-server (written by engine_svc/registration.py), and
membership changes against a real in-process sim engine: a retired replica finishes its requests,
an expired one fails them as retryable."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest
from pydantic import ValidationError

from engine_svc.app import start_engine
from engine_svc.config import EngineSettings
from engine_svc.registration import Registration, advertise_address
from engine_svc.registration import registry_key as engine_side_key
from router_svc.config import UpstreamSettings
from router_svc.discovery import (
    Discovery,
    DnsSource,
    Entry,
    Member,
    Reading,
    RegistrySource,
    build_sources,
    parse_entry,
    parse_registry,
    registry_key,
    resolve_once,
)
from router_svc.types import Sampling
from router_svc.upstreams import EnginePool
from services.errors import Reason
from services.mux import StreamBroken
from tests.redisproc import RedisProc
from tests.waiting import poll


# ------------------------------------------------------------------------------------------ entries
@pytest.mark.parametrize(("text", "entry"), [
    ("127.0.0.1:5001", Entry("default", "127.0.0.1:5001")),
    ("canary@127.0.0.1:5001", Entry("canary", "127.0.0.1:5001")),
    ("canary@dns:eng-canary:50051", Entry("canary", "eng-canary:50051", dns=True)),
    ("dns:eng.svc.cluster.local:50051", Entry("default", "eng.svc.cluster.local:50051", dns=True)),
    ("[::1]:7000", Entry("default", "[::1]:7000")),
    ("b.2@unix:/run/engine.sock", Entry("b.2", "unix:/run/engine.sock")),
])
def test_entries_parse(text: str, entry: Entry) -> None:
    assert parse_entry(text) == entry


@pytest.mark.parametrize("text", ["nohost", "host:", "host:0", "host:70000", "dns:host", "dns::80", "bad pool@h:1",
                                  "unix:", "@h:1"])
def test_bad_entries_are_refused_by_the_settings(text: str) -> None:
    with pytest.raises(ValueError):
        parse_entry(text)
    with pytest.raises(ValidationError):
        UpstreamSettings(engines=[text])


def test_engine_and_router_share_the_registry_key() -> None:
    assert registry_key("p1") == engine_side_key("p1") == "tq:{p1}:engines"


def test_an_engine_advertises_what_routers_can_dial() -> None:
    assert advertise_address("", "127.0.0.1", 5001) == "127.0.0.1:5001"
    assert advertise_address("eng-0.eng:50051", "0.0.0.0", 5001) == "eng-0.eng:50051"
    assert advertise_address("", "::1", 5001) == "[::1]:5001"
    assert advertise_address("", "0.0.0.0", 5001) == f"{socket.getfqdn()}:5001"


# ---------------------------------------------------------------------------------------------- dns
async def test_dns_name_gives_one_replica_per_address_without_duplicates() -> None:
    reading = await DnsSource(parse_entry("canary@dns:localhost:5001"), interval=1).read()
    assert reading is not None
    # getaddrinfo lists each address once per socket type without the filter (and may list it twice).
    raw = {str(info[4][0]) for info in socket.getaddrinfo("localhost", 5001)}
    expected = {f"[{ip}]:5001" if ":" in ip else f"{ip}:5001" for ip in raw}
    assert set(reading.members) == expected and "127.0.0.1:5001" in expected
    assert all(m.pool == "canary" for m in reading.members.values())
    # The tokenizers' one-off resolution: records in order, a repeated address once, plain ones kept.
    assert await resolve_once(["dns:localhost:5001", "127.0.0.1:5001", "h:1"]) == [*sorted(expected), "h:1"]


async def test_a_failed_lookup_keeps_the_last_set() -> None:
    source = DnsSource(parse_entry("dns:no-such-host.invalid:5001"), interval=1, timeout=5)
    assert await source.read() is None and source._warn.failing
    pool = EnginePool()
    discovery = Discovery([source], pool)
    discovery.readings[source.name] = Reading({"10.0.0.1:5001": Member("default", "10.0.0.1:5001")})
    discovery.sync()
    assert pool.addresses() == ["10.0.0.1:5001"]
    await discovery.start()                                              # the read fails: nothing removed
    assert pool.addresses() == ["10.0.0.1:5001"]
    await discovery.close()
    await pool.close()


# ----------------------------------------------------------------------------------------- registry
async def test_registry_lists_live_engines_expires_silent_ones_and_forgets_deleted_ones(
        redis_proc: RedisProc) -> None:
    report: dict[str, Any] = {"pool": "canary", "active": 2, "queued": 1, "max_active": 8, "kv_used": 10,
                              "kv_total": 64, "draining": False}
    a = Registration(redis_proc.url, "p1", "10.0.0.1:1", lambda: report, heartbeat=0.05, ttl=0.4)
    b = Registration(redis_proc.url, "p1", "10.0.0.2:1", lambda: {"pool": "default"}, heartbeat=0.05, ttl=0.4)
    source = RegistrySource(redis_proc.url, "p1", interval=0.05)
    try:
        await a.start()
        await b.start()
        reading = await source.read()
        assert reading is not None and set(reading.members) == {"10.0.0.1:1", "10.0.0.2:1"}
        m = reading.members["10.0.0.1:1"]
        assert m.pool == "canary" and not m.draining and m.load is not None
        assert (m.load.active, m.load.queued, m.load.max_active, m.load.kv_used, m.load.kv_total) == (2, 1, 8, 10, 64)
        report["draining"] = True
        a.wake()
        await poll(_member(source, "10.0.0.1:1", lambda m: m.draining), timeout=5, what="the drain flag")

        await b.close(deregister=False)                                  # b stops beating without a word
        expired = await poll(_expired(source, "10.0.0.2:1"), timeout=5, what="b to expire")
        assert "10.0.0.2:1" not in expired.members and "10.0.0.1:1" in expired.members
        await a.close()                                                  # a clean stop deletes the entry
        gone = await source.read()
        assert gone is not None and "10.0.0.1:1" not in gone.members and "10.0.0.1:1" not in gone.expired
    finally:
        await b.close()
        await source.close()


def test_a_malformed_registry_entry_is_skipped() -> None:
    reading = parse_registry(5, [b"10.0.0.1:1", b'99 {"pool":"x"}', b"junk", b"99 {}", b"10.0.0.2:1", b"1 {}",
                                 b"10.0.0.3:1", b"99 notjson", b"dns:h:1", b"99 {}"])
    assert list(reading.members) == ["10.0.0.1:1"] and reading.members["10.0.0.1:1"].pool == "x"
    assert reading.expired == {"10.0.0.2:1"}


async def test_redis_down_engines_keep_beating_quietly_and_routers_keep_their_set(redis_proc: RedisProc) -> None:
    reg = Registration(redis_proc.url, "p2", "10.0.0.3:1", lambda: {"pool": "default"}, heartbeat=0.05, ttl=1.0,
                       timeout=0.2)
    source = RegistrySource(redis_proc.url, "p2", interval=0.05, timeout=0.2)
    pool = EnginePool()
    discovery = Discovery([source], pool)
    try:
        await reg.start()
        await discovery.start()
        assert pool.addresses() == ["10.0.0.3:1"]
        redis_proc.kill()
        assert await source.read() is None
        assert not await reg.beat() and reg._failing
        discovery.sync()
        assert pool.addresses() == ["10.0.0.3:1"]                        # the last known set
        redis_proc.start()
        await poll(lambda: not reg._failing, timeout=10, what="the engine to register again")
        assert await source.read() is not None
    finally:
        await reg.close()
        await discovery.close()
        await pool.close()


def _member(source: RegistrySource, address: str, check: Any):
    async def ok() -> bool:
        reading = await source.read()
        return bool(reading and address in reading.members and check(reading.members[address]))
    return ok


def _expired(source: RegistrySource, address: str):
    async def ok() -> Reading | None:
        reading = await source.read()
        return reading if reading and address in reading.expired else None
    return ok


# --------------------------------------------------------------------------------------- membership
class _Source:
    name = "test"
    interval = 0.0

    def __init__(self) -> None:
        self.reading = Reading({})

    async def read(self) -> Reading:
        return self.reading

    async def close(self) -> None:
        return None


def _reading(*members: tuple[str, str], expired: frozenset[str] = frozenset()) -> Reading:
    return Reading({a: Member(p, a) for p, a in members}, expired)


async def test_pool_follows_its_sources_and_tells_its_listeners() -> None:
    pool = EnginePool()
    heard: list[tuple[list[str], list[str]]] = []
    pool.add_listener(lambda added, removed: heard.append((added, removed)))
    source = _Source()
    discovery = Discovery([source], pool)
    source.reading = _reading(("default", "10.0.0.1:1"), ("canary", "10.0.0.2:1"))
    await discovery.start()
    assert sorted(pool.addresses()) == ["10.0.0.1:1", "10.0.0.2:1"]
    assert {s.address: s.pool for s in pool.snapshots()} == {"10.0.0.1:1": "default", "10.0.0.2:1": "canary"}
    source.reading = _reading(("default", "10.0.0.1:1"))
    await discovery.refresh()
    await discovery.refresh()                          # no change: nothing heard
    assert pool.addresses() == ["10.0.0.1:1"]
    assert heard == [(["10.0.0.1:1"], []), (["10.0.0.2:1"], []), ([], ["10.0.0.2:1"])]
    # Calls for a replica that has left are no-ops, not errors (the engine stage's retry path).
    pool.mark_failed("10.0.0.2:1")
    pool.release("10.0.0.2:1", "r")
    pool.abort("10.0.0.2:1", "r")
    with pytest.raises(Exception) as info:
        pool.submit("10.0.0.2:1", "r", [1], Sampling(max_tokens=1), [], "", {})
    assert getattr(info.value, "reason", None) == Reason.NO_HEALTHY_REPLICA
    await discovery.close()
    await pool.close()


async def test_retired_replica_finishes_its_requests_and_an_expired_one_fails_them_retryably() -> None:
    engine, server = await start_engine(EngineSettings(**{
        "port": 0, "sim_vocab_size": 600, "sim_decode_step_time": 0.01, "sim_eos_probability": 0.0,
        "sim_max_context": 4096}))
    pool = EnginePool(poll_interval=3600)
    try:
        await pool.start()
        pool.add("default", server.address)
        long = Sampling(max_tokens=3000, ignore_eos=True)
        inbox = pool.submit(server.address, "kept", [1, 2, 3], long, [], "", {})
        assert not isinstance(await asyncio.wait_for(inbox.get(), 10), StreamBroken)

        assert pool.remove(server.address)               # retired: no new work, its request goes on
        assert pool.addresses() == [] and pool.snapshots() == []
        got = await asyncio.wait_for(inbox.get_ready(), 10)
        assert got and not any(isinstance(c, StreamBroken) for c in got)
        await pool.poll_once()                           # still in flight: not closed
        assert not any(isinstance(c, StreamBroken) for c in await asyncio.wait_for(inbox.get_ready(), 10))
        pool.abort(server.address, "kept")               # abort and release still reach it
        pool.release(server.address, "kept")
        await pool.poll_once()                           # no request left: closed

        pool.add("default", server.address)              # back (a new channel)
        inbox = pool.submit(server.address, "cut", [1, 2, 3], long, [], "", {})
        assert not isinstance(await asyncio.wait_for(inbox.get(), 10), StreamBroken)
        pool.remove(server.address, now=True)            # its registry entry expired
        broken = await poll(_broken(inbox), timeout=10, what="the in-flight stream to fail")
        assert broken.error.reason == Reason.UPSTREAM_UNAVAILABLE and broken.error.retryable
    finally:
        await pool.close()
        await server.stop(0)
        await engine.close()


def _broken(inbox: Any):
    async def ok() -> StreamBroken | None:
        for item in await asyncio.wait_for(inbox.get_ready(), 10):
            if isinstance(item, StreamBroken):
                return item
        return None
    return ok


async def test_an_engine_refusing_work_as_not_ready_leaves_rotation_without_a_failure() -> None:
    engine, server = await start_engine(EngineSettings(**{"port": 0, "sim_vocab_size": 600}))
    pool = EnginePool([server.address], poll_interval=3600)
    try:
        replica = pool.replicas[0]
        engine.drain()
        inbox = pool.submit(server.address, "r", [1, 2, 3], Sampling(max_tokens=2), [], "", {})
        chunk = await asyncio.wait_for(inbox.get(), 10)
        assert not isinstance(chunk, StreamBroken) and chunk.error_reason == Reason.SHUTTING_DOWN.value
        pool.release(server.address, "r")
        pool.mark_failed(server.address)              # what the engine stage does with SHUTTING_DOWN
        snap = pool.snapshots()[0]
        assert not snap.serving and snap.healthy and replica.breaker.clean()
    finally:
        await pool.close()
        await server.stop(0)
        await engine.close()


async def test_a_dns_entry_puts_the_engine_behind_the_name_in_the_pool_and_it_serves() -> None:
    engine, server = await start_engine(EngineSettings(**{"port": 0, "sim_vocab_size": 600}))
    discovery = Discovery(build_sources([f"canary@dns:localhost:{server.port}"], dns_interval=0.1), EnginePool())
    pool = discovery.pool
    try:
        await discovery.start()
        v4 = f"127.0.0.1:{server.port}"
        assert v4 in pool.addresses() and len(pool.addresses()) == len(set(pool.addresses()))
        assert {s.pool for s in pool.snapshots()} == {"canary"}
        inbox = pool.submit(v4, "r", [1, 2, 3], Sampling(max_tokens=2, ignore_eos=True), [], "", {})
        chunks = [await asyncio.wait_for(inbox.get(), 10) for _ in range(2)]
        assert all(not isinstance(c, StreamBroken) and not c.error_reason for c in chunks)
        pool.release(v4, "r")
    finally:
        await discovery.close()
        await pool.close()
        await server.stop(0)
        await engine.close()


def test_a_router_needs_engines_from_somewhere() -> None:
    from router_svc.admission_settings import AdmissionSettings
    from router_svc.config import RoutingSettings
    from router_svc.discovery import from_settings
    from services.security import PLAINTEXT

    with pytest.raises(ValueError, match="--engines or --engine-registry"):
        from_settings(UpstreamSettings(), RoutingSettings(), AdmissionSettings(), PLAINTEXT)
    discovery = from_settings(UpstreamSettings(engine_registry=True, engines=["a@h:1", "dns:h:2"]),
                              RoutingSettings(breaker_failures=5), AdmissionSettings(pool="p9"), PLAINTEXT)
    assert [s.name for s in discovery.sources] == ["static", "dns:h:2", "registry:p9"]
    with pytest.raises(ValidationError):
        RoutingSettings(breaker_backoff=10, breaker_max_backoff=5)
