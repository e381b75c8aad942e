"""PlacementShare in one process over a real redis-server: two routers' indexes, what one records
the other enters (pending, with the same expiry), in-flight vectors, and Redis down."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from prometheus_client import REGISTRY

from router_svc.cluster_redis import Pipeliner, open_redis
from router_svc.placement import PrefixAware
from router_svc.placement_share import PlacementShare, pack_keys, unpack_keys
from router_svc.ports import PlacementView, ReplicaSnapshot
from router_svc.prefix_index import PrefixIndex, block_keys
from tests.waiting import poll

PROMPT = list(range(1, 200))
E = ["e0:1", "e1:1", "e2:1"]


def _index() -> PrefixIndex:
    index = PrefixIndex(tokens_per_block=16)
    for address in E:
        index.reset(address, events=True)     # replicas with KV events: placements are pending entries
    return index


async def _share(url: str, name: str, index: PrefixIndex, in_flight: dict[str, int],
                 pool: str = "unit") -> tuple[PlacementShare, Pipeliner]:
    redis = open_redis(url, 0.5)
    pipe = Pipeliner(redis, 0.5)
    pipe.start()
    share = PlacementShare(redis, pipe, pool, name, index, lambda: in_flight, op_timeout=0.5, tick=0.02)
    await share.start()
    return share, pipe


def _sent(event: str) -> float:
    return REGISTRY.get_sample_value("tokenrelay_router_placement_share_total", {"event": event}) or 0.0


def test_keys_pack_round_trip() -> None:
    keys = block_keys(PROMPT, 16, "tenant")
    assert list(unpack_keys(pack_keys(keys))) == keys
    with pytest.raises(ValueError):
        unpack_keys("AAAA")    # 3 bytes: not int64s


def test_remote_placements_expire_like_local_ones() -> None:
    now = [100.0]
    index = PrefixIndex(tokens_per_block=16, pending_ttl=5.0, clock=lambda: now[0])
    index.reset("e0:1", events=True)
    index.reset("e1:1", events=False)          # no events: routing history
    keys = block_keys(PROMPT, 16, "t")
    index.remote("e0:1", keys, "placed", age=4.0)     # heard 4 s late: 1 s of pending left
    index.remote("e0:1", keys[:2], "finished")          # finished: history only, nothing here
    assert index.match(PROMPT, ["e0:1"], "t") == {"e0:1": (len(PROMPT) - 1) // 16}
    now[0] += 1.5
    assert index.match(PROMPT, ["e0:1"], "t") == {}
    index.remote("e0:1", keys, "placed", age=6.0)     # older than the ttl: ignored
    assert index.stats("e0:1")["pending"] == 0
    index.remote("e1:1", keys, "finished")
    assert index.match(PROMPT, ["e1:1"], "t") == {"e1:1": (len(PROMPT) - 1) // 16}
    index.remote("elsewhere:1", keys, "placed")      # a replica this router does not follow
    assert index.match(PROMPT, ["elsewhere:1"], "t") == {}


async def test_the_buffer_is_bounded() -> None:
    index = _index()
    share = PlacementShare(None, None, "unit", "r", index, dict, max_buffer=3, max_publishes=0)  # type: ignore[arg-type]
    dropped = _sent("dropped")
    for _ in range(5):
        share.record("e0:1", block_keys(PROMPT, 16, "t"), "placed")
    share._flush()                # a publish budget of 0: nothing leaves, records wait
    assert len(share._buffer) == 3 and _sent("dropped") == dropped + 2


async def test_a_placement_reaches_the_other_router(redis_url: str) -> None:
    ia, ib = _index(), _index()
    a_flight: dict[str, int] = {}
    a, pa = await _share(redis_url, "ra", ia, a_flight)
    b, pb = await _share(redis_url, "rb", ib, {})
    try:
        assert ib.match(PROMPT, E, "t") == {}
        a_flight["e1:1"] = 3
        t0 = time.monotonic()
        ia.placed("e1:1", PROMPT, "t")
        await poll(lambda: ib.match(PROMPT, E, "t"), timeout=2, what="router b to hear router a's placement")
        assert time.monotonic() - t0 < 0.5
        assert ib.match(PROMPT, E, "t") == {"e1:1": (len(PROMPT) - 1) // 16}
        assert ib.stats("e1:1")["pending"] == len(PROMPT) // 16     # pending, as its own would be
        assert ia.stats("e0:1")["pending"] == 0 and a.received == 0    # a ignores its own records
        await poll(lambda: b.remote_in_flight() == {"e1:1": 3}, timeout=2, what="a's in-flight vector")
        # The policy weighs a's requests: e1 now counts 3 on router b, so a prompt nobody holds goes elsewhere.
        policy = PrefixAware(ib, remote_in_flight=b.remote_in_flight)
        view = PlacementView("t", "", 40, "", "", list(range(500, 540)), "t", 4)
        snaps = [ReplicaSnapshot(address) for address in ("e1:1", "e0:1", "e2:1")]
        assert policy.choose(snaps, view) == "e0:1"
        a_flight.clear()          # its requests ended: the ticker says so
        await poll(lambda: b.remote_in_flight() == {}, timeout=2, what="a's in-flight to drop")
    finally:
        for share, pipe in ((a, pa), (b, pb)):
            await share.close()
            await pipe.close()


async def test_a_request_end_reaches_the_other_router_at_once_not_at_the_next_tick(redis_url: str) -> None:
    """A conversation's next turn follows its last within milliseconds, often through the other router:
    an end must not wait for the ticker (here 5 s) to reach it."""
    ia, ib = _index(), _index()
    a_flight = {"e1:1": 1}
    redis = open_redis(redis_url, 0.5)
    pa, pb = Pipeliner(redis, 0.5), Pipeliner(redis, 0.5)
    pa.start()
    pb.start()
    a = PlacementShare(redis, pa, "ends", "ra", ia, lambda: a_flight, op_timeout=0.5, tick=5.0)
    b = PlacementShare(redis, pb, "ends", "rb", ib, dict, op_timeout=0.5, tick=5.0)
    await a.start()
    await b.start()
    try:
        ia.placed("e1:1", PROMPT, "t")      # the placement's flush carries the count
        await poll(lambda: b.remote_in_flight() == {"e1:1": 1}, timeout=2, what="a's in-flight vector")
        a_flight.clear()
        t0 = time.monotonic()
        a.changed()                          # EnginePool.release calls it (router_svc/app.py)
        await poll(lambda: b.remote_in_flight() == {}, timeout=2, what="a's request end")
        assert time.monotonic() - t0 < 0.5
    finally:
        for share, pipe in ((a, pa), (b, pb)):
            await share.close()
            await pipe.close()


async def test_redis_down_each_router_keeps_its_own_view(tmp_path) -> None:
    index = _index()
    failed = _sent("publish_failed")
    t0 = time.monotonic()
    share, pipe = await _share(f"unix://{tmp_path}/no-redis.sock", "rx", index, {"e0:1": 1})
    try:
        assert time.monotonic() - t0 < 2.5                     # bounded start, no hang
        assert not share.subscribed.is_set()
        index.placed("e2:1", PROMPT, "t")                       # never raises, never waits
        assert index.match(PROMPT, E, "t") == {"e2:1": (len(PROMPT) - 1) // 16}
        await poll(lambda: _sent("publish_failed") > failed, timeout=3, what="the failed publish to be counted")
        await asyncio.sleep(0)
    finally:
        await share.close()
        await pipe.close()


async def test_a_hold_reaches_the_other_router_and_its_follow_up_there_consumes_it_here(redis_url: str) -> None:
    """A conversation's turns alternate between routers: the hold a's end leaves must keep b's new
    conversations off the replica, and b's placement of the next turn must end a's hold."""
    ia, ib = _index(), _index()
    a, pa = await _share(redis_url, "ra", ia, {}, pool="holds")
    b, pb = await _share(redis_url, "rb", ib, {}, pool="holds")
    other = list(range(300, 400))
    try:
        ia.hold("e1:1", PROMPT, "t")
        await poll(lambda: ib.held(other, "t", E), timeout=2, what="router b to hear router a's hold")
        assert list(ib.held(other, "t", E)) == ["e1:1"] and ib.held([*PROMPT, 5], "t", E) == {}
        ib.placed("e1:1", [*PROMPT, 5, 6, 7], "t")      # the next turn, through b
        assert ib.holds() == 0
        await poll(lambda: ia.holds() == 0, timeout=2, what="b's placement to consume a's hold")
    finally:
        for share, pipe in ((a, pa), (b, pb)):
            await share.close()
            await pipe.close()


def test_holds_in_a_message_unreadable_drop_it_whole_stale_are_ignored_fresh_are_entered() -> None:
    index = _index()
    share = PlacementShare(None, None, "p", "me", index, dict)
    before = _sent("bad_message")
    share.on_message('{"r": "x", "t": 0, "f": {}, "p": [], "h": [["e0:1", "AAAA"]]}')
    assert _sent("bad_message") == before + 1 and index.holds() == 0
    share.on_message('{"r": "x", "t": 0, "f": {}, "p": [], "h": [["e0:1", "' + pack_keys([7]) + '"]]}')
    assert index.holds() == 0       # t 0: 60 s old, past the hold's ttl
    fresh = {"r": "x", "t": time.time(), "f": {}, "p": [], "h": [["e0:1", pack_keys([7])]]}
    share.on_message(json.dumps(fresh))
    assert index.holds() == 1


async def test_a_router_alone_publishes_nothing_until_another_joins(redis_url: str) -> None:
    """PUBLISH says how many heard it: alone (only itself subscribed), a router skips its flushes but one
    every `refresh` s; a router that subscribes publishes at once, and the first one shares again."""
    ia, ib = _index(), _index()
    redis = open_redis(redis_url, 0.5)
    pa, pb = Pipeliner(redis, 0.5), Pipeliner(redis, 0.5)
    pa.start()
    pb.start()
    a = PlacementShare(redis, pa, "alone", "ra", ia, dict, op_timeout=0.5, tick=0.05, refresh=30.0, stale=0.2)
    b = PlacementShare(redis, pb, "alone", "rb", ib, dict, op_timeout=0.5, tick=0.05, refresh=30.0, stale=0.2)
    await a.start()
    try:
        assert not a._alone          # within `stale` of subscribing: a joining router may not be heard yet
        await asyncio.sleep(0.25)
        ia.placed("e1:1", PROMPT, "t")          # its PUBLISH is heard by router a alone
        await poll(lambda: a._alone, timeout=2, what="router a to learn it is alone")
        sent, alone = _sent("sent"), _sent("alone")
        for _ in range(3):
            ia.placed("e1:1", PROMPT, "t")
            await asyncio.sleep(0.02)
        assert _sent("sent") == sent and _sent("alone") == alone + 3     # nobody to tell
        await b.start()
        await poll(lambda: not a._alone, timeout=2, what="router a to hear router b join")
        t0 = time.monotonic()
        ia.placed("e1:1", PROMPT, "t")
        await poll(lambda: ib.match(PROMPT, E, "t"), timeout=2, what="router b to hear router a's placement")
        assert time.monotonic() - t0 < 0.5 and _sent("sent") > sent
    finally:
        for share, pipe in ((a, pa), (b, pb)):
            await share.close()
            await pipe.close()


async def test_a_router_ignores_its_own_messages_unparsed() -> None:
    share = PlacementShare(None, None, "unit", 'r"1', _index(), dict)  # type: ignore[arg-type]
    own = json.dumps({"r": 'r"1', "t": 0, "f": {"e0:1": 1}, "p": []}, separators=(",", ":"))
    share.on_message(own + "garbage")           # never parsed: no bad_message
    share.on_message(own.encode())
    assert share._remote == {}
    bad = _sent("bad_message")
    share.on_message(own.replace('r\\"1', "r2") + "garbage")
    assert _sent("bad_message") == bad + 1
