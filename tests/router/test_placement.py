"""The placement policy, pure: least loaded, draining / unhealthy / excluded never chosen, stickiness."""

from __future__ import annotations

import pytest

from router_svc.placement import LeastLoaded, LocalSessionAffinity
from router_svc.ports import PlacementView, ReplicaSnapshot
from services.errors import Reason, TokenrelayError

POLICY = LeastLoaded()
VIEW = PlacementView("t")


def snap(address: str, **kw: object) -> ReplicaSnapshot:
    return ReplicaSnapshot(address, **kw)  # type: ignore[arg-type]


def test_the_least_outstanding_work_wins() -> None:
    snaps = [snap("a", in_flight=3), snap("b", in_flight=1, queued=1), snap("c", in_flight=1)]
    assert POLICY.choose(snaps, VIEW) == "c"


def test_ties_go_to_fewer_active_then_less_kv() -> None:
    assert POLICY.choose([snap("a", active=4), snap("b", active=2)], VIEW) == "b"
    assert POLICY.choose([snap("a", kv_used=9, kv_total=10), snap("b", kv_used=1, kv_total=10)], VIEW) == "b"


def test_draining_unhealthy_and_excluded_replicas_get_no_new_work() -> None:
    snaps = [snap("drain", serving=False), snap("down", healthy=False), snap("tried"), snap("ok", in_flight=50)]
    assert POLICY.choose(snaps, VIEW, frozenset({"tried"})) == "ok"


def test_nothing_eligible_is_no_healthy_replica() -> None:
    with pytest.raises(TokenrelayError) as info:
        POLICY.choose([snap("a", serving=False), snap("b")], VIEW, frozenset({"b"}))
    assert info.value.reason == Reason.NO_HEALTHY_REPLICA


def test_the_sticky_replica_wins_over_a_less_loaded_one() -> None:
    snaps = [snap("a", in_flight=10), snap("b")]
    assert POLICY.choose(snaps, PlacementView("t", "s", 5, sticky="a")) == "a"


@pytest.mark.parametrize("state", [{"healthy": False}, {"serving": False}])
def test_stickiness_yields_to_an_unhealthy_or_draining_replica(state: dict[str, bool]) -> None:
    snaps = [snap("a", **state), snap("b", in_flight=10)]
    assert POLICY.choose(snaps, PlacementView("t", "s", 5, sticky="a")) == "b"


def test_stickiness_yields_to_the_exclude_list() -> None:
    snaps = [snap("a"), snap("b", in_flight=10)]
    assert POLICY.choose(snaps, PlacementView("t", "s", 5, sticky="a"), frozenset({"a"})) == "b"


async def test_session_affinity_is_scoped_by_tenant_and_bounded() -> None:
    aff = LocalSessionAffinity(capacity=2)
    await aff.set("t1", "s", "a")
    assert await aff.get("t2", "s") == ""
    assert await aff.get("t1", "s") == "a"
    await aff.set("t1", "x", "b")
    await aff.set("t1", "y", "c")
    assert len(aff) == 2 and await aff.get("t1", "s") == ""
