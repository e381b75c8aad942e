"""Holds (router_svc/prefix_index.py, "Holds"): a request's end holds its replica for the
conversation's next turn; the policy weighs other conversations' fresh holds; pure."""

from __future__ import annotations

import pytest

from router_svc import prefix_index
from router_svc.placement import PrefixAware, PrefixWeights
from router_svc.ports import ReplicaSnapshot
from router_svc.prefix_index import PrefixIndex, block_keys
from tests.router.test_prefix_routing import view

TPB = 4
SHARED = list(range(1, 17))            # 4 blocks every conversation starts with
C = [*SHARED, 50, 51, 52, 53, 54]      # conversation C's first turn
C_NEXT = [*C, 60, 61, 62, 63, 64, 65]  # its next turn extends it
D = [*SHARED, 70, 71, 72, 73, 74]      # a new conversation D


def _index(now: list[float], ttl: float = 0.5) -> PrefixIndex:
    index = PrefixIndex(TPB, pending_ttl=5.0, clock=lambda: now[0], hold_ttl=ttl)
    for address in ("a", "b"):
        index.reset(address, events=True)
    return index


def test_a_hold_is_seen_by_other_prompts_not_by_its_own_and_a_follow_up_consumes_it() -> None:
    now = [10.0]
    index = _index(now)
    index.hold("a", C, "t")
    now[0] += 0.1
    assert index.held(D, "t", ["a", "b"]) == {"a": pytest.approx(0.8)}      # 0.1 s of 0.5
    assert index.held(C_NEXT, "t", ["a", "b"]) == {}       # C returns there: not held against it
    index.placed("b", C_NEXT, "t")                          # wherever the next turn goes, it is back
    assert index.held(D, "t", ["a", "b"]) == {} and index.holds() == 0


def test_holds_weigh_by_age_and_expire_and_ttl_zero_keeps_none() -> None:
    now = [10.0]
    index = _index(now)
    index.hold("a", C, "t")
    now[0] += 0.2
    index.hold("a", [*SHARED, 90, 91, 92, 93], "t")
    now[0] += 0.1
    assert index.held(D, "t", ["a"]) == {"a": pytest.approx(0.4 + 0.8)}     # ages 0.3 and 0.1 of 0.5
    now[0] += 0.3
    assert index.held(D, "t", ["a"]) == {"a": pytest.approx(0.2)} and index.holds() == 1   # 0.6 s: gone; 0.4 s
    now[0] += 0.6
    assert index.held(D, "t", ["a", "b"]) == {} and index.holds() == 0
    off = _index(now, ttl=0.0)
    off.hold("a", C, "t")
    assert off.holds() == 0


def test_a_prompt_shorter_than_a_block_leaves_no_hold_and_forget_drops_a_replicas_holds() -> None:
    now = [10.0]
    index = _index(now)
    index.hold("a", [1, 2, 3], "t")
    assert index.holds() == 0
    index.hold("a", C, "t")
    index.hold("b", D, "t")
    index.forget("a")
    assert index.held(C_NEXT, "t", ["a", "b"]) == {"b": 1.0}


def test_another_routers_holds_enter_with_their_age_and_its_placements_consume_them() -> None:
    now = [10.0]
    index = _index(now)
    key = block_keys(C, TPB, "t")[-1]
    index.remote_hold("a", key, age=0.6)      # older than the ttl: ignored
    index.remote_hold("z", key, age=0.0)      # a replica this router does not follow: ignored
    assert index.holds() == 0
    index.remote_hold("a", key, age=0.2)
    assert index.held(D, "t", ["a"]) == {"a": pytest.approx(0.6)}
    index.remote("b", block_keys(C_NEXT, TPB, "t"), "placed")
    assert index.holds() == 0


def test_the_holds_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prefix_index, "MAX_HOLDS", 3)
    now = [10.0]
    index = _index(now)
    prompts = [[i, *SHARED] for i in range(100, 106)]
    for p in prompts:
        index.hold("a", p, "t")
    assert index.holds() == 3
    assert index.held(D, "t", ["a"])["a"] == 3.0


def _snaps() -> list[ReplicaSnapshot]:
    return [ReplicaSnapshot("a", max_active=1), ReplicaSnapshot("b", max_active=1)]


def test_a_new_conversation_leaves_a_held_replica_its_conversations_next_turn_returns() -> None:
    now = [10.0]
    index = _index(now)
    index.placed("a", C, "t")                  # C's first turn: a holds SHARED (pending)
    policy = PrefixAware(index, PrefixWeights(hold_cost=512))
    index.hold("a", C, "t")                    # ... and ended there
    now[0] += 0.01
    assert policy.choose(_snaps(), view(D)) == "b"        # a's cache saves 16 tokens; the hold is worth more
    index.placed("b", D, "t")
    assert policy.choose(_snaps(), view(C_NEXT)) == "a"   # C's own hold is not held against it


def test_the_hold_weighs_less_as_it_ages_and_not_at_all_with_cost_zero() -> None:
    now = [10.0]
    index = _index(now)
    index.placed("a", [*SHARED * 8, 99], "t")             # a caches 32 blocks of a long shared prefix
    long_d = [*SHARED * 8, 70, 71]
    index.hold("a", C, "t")
    policy = PrefixAware(index, PrefixWeights(hold_cost=512))
    now[0] += 0.01
    assert policy.choose(_snaps(), view(long_d)) == "b"   # 128 tokens saved < ~500 of a fresh hold
    now[0] += 0.4
    assert policy.choose(_snaps(), view(long_d)) == "a"   # 128 saved > ~100 of an old one
    now[0] -= 0.4
    assert PrefixAware(index, PrefixWeights(hold_cost=0)).choose(_snaps(), view(long_d)) == "a"
