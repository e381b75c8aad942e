"""The prefix policy under eviction pressure (pure, fake clock): blocks touched in the last
`live_window` seconds are conversations in progress; on a replica whose cache they could outgrow,
those of other conversations weigh against placing a request there (`live_pressure`), so it goes
beside small or ended conversations (stale blocks) rather than large ones in progress."""

from __future__ import annotations

from router_svc.placement import PrefixAware, PrefixWeights, live_pressure
from router_svc.ports import PlacementView, ReplicaSnapshot
from router_svc.prefix_index import PrefixIndex, StoredBlock

TPB = 4


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def conversation(first: int, n_blocks: int) -> list[int]:
    return list(range(first, first + n_blocks * TPB))


def store(index: PrefixIndex, address: str, event_id: int, tokens: list[int], first_hash: int) -> None:
    stored = [StoredBlock(first_hash + i, tokens[i * TPB:(i + 1) * TPB]) for i in range(len(tokens) // TPB)]
    assert index.apply_stored(address, event_id, None, stored, "t")


def view(prompt: list[int], max_tokens: int = 8) -> PlacementView:
    return PlacementView("t", prompt_tokens=len(prompt), prompt_ids=prompt, cache_salt="t", max_tokens=max_tokens)


def full_replicas(clock: Clock) -> PrefixIndex:
    """Two replicas of 24 blocks, each holding a 20-block conversation: `a`'s stored just now (in
    progress), `b`'s 2 s ago (ended)."""
    index = PrefixIndex(TPB, pending_ttl=0, clock=clock, live_window=0.5)
    for address in ("a", "b"):
        index.reset(address, events=True)
    store(index, "b", 1, conversation(1000, 20), 500)
    clock.t += 2.0
    store(index, "a", 1, conversation(2000, 20), 700)
    return index


SNAPS = [ReplicaSnapshot(address, max_active=4, kv_used=0, kv_total=24, tokens_per_block=TPB) for address in "ab"]
NEW = conversation(5000, 6)     # 6 blocks + the reply's 2: either replica must evict for it


ON = PrefixWeights(evict_cost=0.1)


def test_a_new_conversation_goes_where_the_full_cache_is_stale_not_in_progress() -> None:
    clock = Clock()
    index = full_replicas(clock)
    assert PrefixAware(index, ON).choose(SNAPS, view(NEW)) == "b"
    # the rule off (the default): a tie, the first in the pool's order (the behaviour before it)
    assert PrefixAware(index).choose(SNAPS, view(NEW)) == "a"
    clock.t += 1.0      # a's conversation is no longer touched: both stale, a tie again
    assert PrefixAware(index, ON).choose(SNAPS, view(NEW)) == "a"


def test_no_pressure_where_the_cache_has_room_or_from_the_requests_own_prefix() -> None:
    clock = Clock()
    index = full_replicas(clock)
    roomy = [ReplicaSnapshot(s.address, max_active=4, kv_total=1000, tokens_per_block=TPB) for s in SNAPS]
    assert PrefixAware(index, ON).choose(roomy, view(NEW)) == "a"   # room to grow everywhere
    live: dict[str, tuple[int, int, int]] = {}
    follow_up = [*conversation(2000, 20), 1, 2, 3]                   # a's conversation, next turn
    assert index.match(follow_up, ["a", "b"], "t", live) == {"a": 20}
    assert live["a"] == (20, 20, 20) and live["b"] == (20, 0, 0)
    assert live_pressure(SNAPS[0], 20, 5, 20, 20) == 0               # its own blocks: no pressure
    assert live_pressure(SNAPS[0], 20, 5, 20, 0) == 20
    assert live_pressure(roomy[0], 20, 5, 20, 0) == 0                # room for 4x what is held
    assert live_pressure(roomy[0], 200, 51, 20, 0) == 20             # (200 + 51) x 4 > 1000 blocks


def test_live_blocks_are_touched_by_placements_and_events_and_leave_when_removed() -> None:
    clock = Clock()
    index = PrefixIndex(TPB, pending_ttl=5, clock=clock, live_window=0.5)
    index.reset("a", events=True)
    store(index, "a", 0, conversation(1, 3), 10)          # a snapshot: held, not in progress
    assert index.live("a") == 0
    index.placed("a", [*conversation(1, 3), 9], "t")     # a turn of it: its 3 blocks
    assert index.live("a") == 3
    clock.t += 0.4
    store(index, "a", 1, conversation(50, 2), 20)
    assert index.live("a") == 5
    assert index.apply_removed("a", 2, [20])
    assert index.live("a") == 4
    clock.t += 0.2                                        # the placement's touches are 0.6 s old
    assert index.live("a") == 1
