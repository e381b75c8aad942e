"""The traffic split between engine pools (router_svc/pools.py): weights, stickiness, consistent
bucketing, fallback, and its shared config in a real redis-server reloaded without a restart."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from router_svc.cluster_redis import open_redis
from router_svc.config import RouterSettings
from router_svc.pools import (
    SplitConfig,
    SplitSelector,
    SplitStore,
    TrafficSplit,
    parse_weights,
    read_split,
    reset_split,
    sticky_key,
    write_split,
)
from router_svc.ports import ReplicaSnapshot
from services.config import load_settings
from tests.waiting import poll

KEYS = [sticky_key("session", "t", f"sess-{i}", f"r-{i}") for i in range(2000)]


def _split(weights: str, epoch: str = "") -> TrafficSplit:
    return TrafficSplit(SplitConfig.build(weights, epoch=epoch))


def test_ninety_ten_holds_within_two_percent_over_2000_keys_and_is_sticky():
    split = _split("default=90,canary=10")
    picks = [split.pick(k) for k in KEYS]
    share = Counter(picks)["canary"] / len(picks)
    assert abs(share - 0.10) <= 0.02, share
    again = _split("canary=10 default=90")       # another router, the pools written the other way round
    assert [again.pick(k) for k in KEYS] == picks
    # Session stickiness: every request of a session, whatever its id, lands where the session does.
    selector = SplitSelector(lambda: split, lambda: [], "session")
    for i in range(0, 2000, 40):
        pools = {selector.choose("t", f"sess-{i}", f"req-{i}-{n}") for n in range(5)}
        assert pools == {picks[i]}


def test_three_pools_and_other_shares_hold():
    split = _split("a=50,b=30,c=20")
    counts = Counter(split.pick(k) for k in KEYS)
    for pool, want in (("a", 0.5), ("b", 0.3), ("c", 0.2)):
        assert abs(counts[pool] / len(KEYS) - want) <= 0.03, counts


def test_a_weight_change_moves_only_the_keys_that_changed_hands():
    before = [_split("default=90,canary=10").pick(k) for k in KEYS]
    after = [_split("default=80,canary=20").pick(k) for k in KEYS]
    moved = [(b, a) for b, a in zip(before, after, strict=True) if b != a]
    assert 0.07 <= len(moved) / len(KEYS) <= 0.13, len(moved)
    assert set(moved) == {("default", "canary")}          # only toward the pool that grew
    rollback = [_split("default=100").pick(k) for k in KEYS]
    assert set(rollback) == {"default"}
    reshuffled = [_split("default=90,canary=10", epoch="2").pick(k) for k in KEYS]
    assert sum(a != b for a, b in zip(before, reshuffled, strict=True)) > 100   # a new epoch re-buckets


def test_sticky_modes():
    assert sticky_key("session", "t", "s1", "r1") == sticky_key("session", "t", "s1", "r2")
    assert sticky_key("session", "t", "", "r1") == sticky_key("tenant", "t", "s9", "r2")   # no session: tenant
    assert sticky_key("session", "t", "s1", "r") != sticky_key("session", "u", "s1", "r")  # sessions are per tenant
    assert sticky_key("request", "t", "s1", "r1") != sticky_key("request", "t", "s1", "r2")
    split = _split("default=50,canary=50")
    per_request = SplitSelector(lambda: split, lambda: [], "request")
    assert len({per_request.choose("t", "s1", f"r{i}") for i in range(64)}) == 2
    per_tenant = SplitSelector(lambda: split, lambda: [], "tenant")
    assert len({per_tenant.choose("t", f"s{i}", f"r{i}") for i in range(64)}) == 1


def _snap(address: str, pool: str, serving: bool = True) -> ReplicaSnapshot:
    return ReplicaSnapshot(address, healthy=True, serving=serving, pool=pool)


def test_a_pool_without_a_serving_replica_falls_back_to_the_heaviest_weighted_pool():
    split = _split("default=70,canary=20,beta=10")
    replicas = [_snap("a:1", "default"), _snap("b:1", "canary", serving=False), _snap("c:1", "beta"),
                _snap("d:1", "rolled-back")]
    selector = SplitSelector(lambda: split, lambda: replicas)
    chosen = Counter(selector.choose("t", f"s{i}", "r") for i in range(1000))
    assert set(chosen) == {"default", "beta"}           # canary's keys went to the primary, not to beta
    assert 0.07 <= chosen["beta"] / 1000 <= 0.13
    assert split.choose(KEYS[0], {"rolled-back"}).pool in split.pools    # never to a pool of weight 0
    assert not split.choose(KEYS[0], {"rolled-back"}).fallback


def test_parse_weights_refuses_what_is_not_a_split():
    assert parse_weights("default=90, canary=10") == {"default": 90.0, "canary": 10.0}
    for bad in ("", "default", "default=-1", "default=nan", "default=0", "a=1,a=2", "bad name=1", "x=ten",
                ",".join(f"p{i}=1" for i in range(17))):
        with pytest.raises(ValueError):
            parse_weights(bad)
    settings = load_settings(RouterSettings, ["--tenants-file", "t.yaml", "--traffic-split", "canary=10 default=90",
                                    "--shadow-pool", "canary", "--shadow-fraction", "0.05"])
    assert settings.pools.traffic_split == "canary=10,default=90"
    with pytest.raises(SystemExit):
        load_settings(RouterSettings, ["--tenants-file", "t.yaml", "--traffic-split", "default=0"])
    with pytest.raises(SystemExit):
        load_settings(RouterSettings, ["--tenants-file", "t.yaml", "--shadow-fraction", "1.5"])


# ---------------------------------------------------------------------------------- Redis, reload
async def test_a_split_set_in_redis_reaches_every_router_without_a_restart(redis_proc):
    pool = "p1"
    base = SplitConfig.build("default=100", "mirror", 0.5)
    stores = [SplitStore(base, redis_proc.url, pool, poll_interval=30.0) for _ in range(2)]
    admin = open_redis(redis_proc.url, 1.0)
    try:
        for store in stores:
            await store.start()
        assert all(s.config == base for s in stores)              # nothing in Redis: the flags' split
        version = await write_split(admin, pool, {"default": 90, "canary": 10}, who="test")
        assert version == 1
        # The pub/sub notice, not the 30 s poll, brings it to both.
        await poll(lambda: all(s.config.version == 1 for s in stores), timeout=5, what="the notice")
        got = stores[1].config
        assert dict(got.weights) == {"default": 90, "canary": 10}
        assert (got.shadow_pool, got.shadow_fraction) == ("mirror", 0.5)    # not set in Redis: the flags'
        await write_split(admin, pool, None, shadow=("canary", 0.05))       # the shadow alone
        await poll(lambda: all(s.config.version == 2 for s in stores), timeout=5, what="the shadow change")
        assert (stores[0].config.shadow_pool, stores[0].config.shadow_fraction) == ("canary", 0.05)
        assert dict(stores[0].config.weights) == {"default": 90, "canary": 10}
        await write_split(admin, pool, {"default": 100}, shadow=("", 0.0))   # instant rollback, shadow off
        await poll(lambda: all(s.config.version == 3 for s in stores), timeout=5, what="the rollback")
        assert stores[0].split().pools == ["default"] and stores[0].config.shadow_pool == ""
        assert (await read_split(admin, pool))["weights"] == "default=100"
        await reset_split(admin, pool)
        await poll(lambda: all(s.config == base for s in stores), timeout=5, what="the reset")
    finally:
        for store in stores:
            await store.close()
        await admin.aclose()


async def test_the_poll_catches_a_missed_notice_and_a_bad_value_keeps_the_split(redis_proc):
    pool = "p2"
    store = SplitStore(SplitConfig.build("default=100"), redis_proc.url, pool, poll_interval=0.2)
    admin = open_redis(redis_proc.url, 1.0)
    try:
        await store.start()
        # Written behind the routers' back (no PUBLISH): the poll finds it.
        await admin.hset(f"tq:{{{pool}}}:split", mapping={"weights": "default=50,canary=50", "version": 7})
        await poll(lambda: store.config.version == 7, timeout=5, what="the poll")
        await admin.hset(f"tq:{{{pool}}}:split", mapping={"weights": "default=-3", "version": 8})
        reads = store.reloads
        await poll(lambda: store.reloads >= reads + 2, timeout=5, what="two more polls")
        assert store.config.version == 7 and dict(store.config.weights) == {"default": 50, "canary": 50}
        redis_proc.kill()                                   # Redis gone: the split served stays
        reads = store.reloads
        await poll(lambda: store.reloads >= reads + 2, timeout=10, what="polls against a dead Redis")
        assert store.config.version == 7
        await asyncio.sleep(0)
    finally:
        await store.close()
        await admin.aclose()


def test_split_cli_refuses_bad_input_in_one_line(capsys):
    from tokenrelay_tools.cli.main import main

    for argv in (["split", "set", "default=x"], ["split", "set"], ["split", "set", "default=1", "--shadow", "c:2"],
                 ["split", "set", "--shadow", "canary"]):
        assert main([*argv, "--redis-url", "unix:///nonexistent.sock"]) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("tokenrelay split: error:") and err.count("\n") == 1, err
    assert main(["split", "show", "--redis-url", "unix:///nonexistent.sock"]) == 1      # Redis unreachable
    assert "Traceback" not in capsys.readouterr().err


def test_admission_counts_the_room_of_routed_pools_only():
    # A shadow-only (or rolled-back, weight 0) pool runs no primary request: its replicas add no
    # capacity to the admission queue, which would otherwise dispatch more than the primary can run.
    from router_svc.adapters import build_router
    from router_svc.admission import pool_capacity

    class Engines:
        max_context = 4096

        def snapshots(self) -> list[ReplicaSnapshot]:
            return [ReplicaSnapshot("a:1", max_active=8), ReplicaSnapshot("b:1", max_active=8),
                    ReplicaSnapshot("s:1", max_active=8, pool="shadow"),
                    ReplicaSnapshot("r:1", max_active=8, pool="rolled-back")]

    class Adm:
        snapshots = None

        def use_engines(self, snapshots):
            self.snapshots = snapshots

    split = _split("default=100")
    adm = Adm()
    build_router(object(), Engines(), adm, pools=SplitSelector(lambda: split, Engines().snapshots))
    assert pool_capacity(adm.snapshots(), 1.0, 0.9, 4) == 16
    both = _split("default=50,shadow=50")
    build_router(object(), Engines(), adm, pools=SplitSelector(lambda: both, Engines().snapshots))
    assert pool_capacity(adm.snapshots(), 1.0, 0.9, 4) == 24
    build_router(object(), Engines(), adm)          # no pools wired: every replica counts
    assert pool_capacity(adm.snapshots(), 1.0, 0.9, 4) == 32
