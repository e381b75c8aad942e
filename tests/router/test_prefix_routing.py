"""The prefix index (events, gaps, salts, recent placements, history with eviction) and the
prefix-aware policy (hits weighed against load, never a hit at any price), pure."""

from __future__ import annotations

from router_svc.placement import PrefixAware, PrefixWeights, RoundRobin, SessionOnly, make_policy, saturated
from router_svc.ports import PlacementView, ReplicaSnapshot
from router_svc.prefix_index import PrefixIndex, StoredBlock, block_keys

TPB = 4


def blocks(tokens: list[int], first_hash: int = 100) -> list[StoredBlock]:
    return [StoredBlock(first_hash + i, tokens[i * TPB:(i + 1) * TPB]) for i in range(len(tokens) // TPB)]


def view(prompt: list[int], **kw: object) -> PlacementView:
    return PlacementView("t", prompt_tokens=len(prompt), prompt_ids=prompt, cache_salt="t", **kw)  # type: ignore[arg-type]


PROMPT = list(range(1, 18))   # 4 full blocks + 1 token


def test_keys_chain_and_depend_on_salt_and_block_size() -> None:
    assert len(block_keys(PROMPT, TPB)) == 4
    assert block_keys(PROMPT, TPB, "a")[:2] == block_keys(PROMPT[:8], TPB, "a")
    assert block_keys(PROMPT, TPB, "a") != block_keys(PROMPT, TPB, "b")
    assert block_keys([9, *PROMPT[1:]], TPB)[3] != block_keys(PROMPT, TPB)[3]   # a changed first token


def test_a_chain_goes_on_from_keys_already_computed() -> None:
    assert block_keys(PROMPT, TPB, "a", first=block_keys(PROMPT, TPB, "a", limit=2)) == block_keys(PROMPT, TPB, "a")
    assert block_keys(PROMPT[:8], TPB, "a", first=block_keys(PROMPT, TPB, "a")) == block_keys(PROMPT[:8], TPB, "a")


def test_a_placement_takes_the_keys_its_match_computed(monkeypatch) -> None:
    """`placed` right after `match` for the same prompt (one placement decision), and `hold` when no
    other prompt was matched since, go on from the keys `match` computed instead of hashing the prompt
    again; the index ends up the same either way. A prompt of exactly 4 blocks: `match` leaves the last
    out (the engine computes the last token)."""
    import router_svc.prefix_index as pi

    hashed: list[int] = []
    real = pi.block_keys

    def counting(tokens, tpb, salt="", limit=None, first=()):  # type: ignore[no-untyped-def]
        keys = real(tokens, tpb, salt, limit, first)
        hashed.append(len(keys) - len(first[:len(keys)]))
        return keys

    monkeypatch.setattr(pi, "block_keys", counting)
    prompt = PROMPT[:16]
    a, b = PrefixIndex(TPB, pending_ttl=5), PrefixIndex(TPB, pending_ttl=5)
    for index in (a, b):
        index.reset("r", events=True)
    a.match(prompt, ["r"], "t")
    hashed.clear()
    a.placed("r", prompt, "t")
    assert hashed == [1]                                     # only the block `match` left out
    b.placed("r", prompt, "t")                               # no match before: the whole chain
    assert hashed == [1, 4]
    assert a.match(prompt, ["r"], "t") == b.match(prompt, ["r"], "t") == {"r": 3}
    assert a.placed("r", list(prompt), "t") and hashed[-1] == 4   # another list (even equal): hashed again
    a.match(prompt, ["r"], "t")
    a.hold("r", prompt, "t")                                 # its end, nothing placed since: the same keys
    assert hashed[-1] == 1


def test_stored_events_make_a_replica_hold_the_prefix_and_removed_ones_drop_it() -> None:
    index = PrefixIndex(TPB, pending_ttl=0)
    index.reset("a", events=True)
    assert index.apply_stored("a", 1, None, blocks(PROMPT[:8]), "t")
    assert index.match(PROMPT, ["a", "b"], "t") == {"a": 2}
    # a child event hangs from the engine's hash of block 2
    assert index.apply_stored("a", 2, 101, [StoredBlock(200, PROMPT[8:12])], "t")
    assert index.match(PROMPT, ["a"], "t") == {"a": 3}
    assert index.apply_removed("a", 3, [101])
    assert index.match(PROMPT, ["a"], "t") == {"a": 1}
    assert index.match(PROMPT, ["a"], "other-tenant") == {}


def test_a_gap_in_event_ids_is_reported_and_snapshot_events_do_not_count() -> None:
    index = PrefixIndex(TPB)
    index.reset("a", events=True)
    assert index.apply_stored("a", 0, None, blocks(PROMPT[:4]), "t")     # snapshot
    assert index.apply_stored("a", 7, None, blocks(PROMPT[:8], 300), "t")
    assert not index.apply_removed("a", 9, [300])                        # 8 was lost
    assert index.stats("a")["gaps"] == 1


def test_unsalted_events_match_salted_requests_for_that_replica_only() -> None:
    index = PrefixIndex(TPB, pending_ttl=0)
    index.reset("trt", events=True)
    index.apply_stored("trt", 1, None, blocks(PROMPT[:8]), None)        # TensorRT-LLM: no salt
    assert index.match(PROMPT, ["trt"], "t") == {"trt": 2}


def test_partial_blocks_and_unknown_parents_are_ignored() -> None:
    index = PrefixIndex(TPB, pending_ttl=0)
    index.reset("a", events=True)
    index.apply_stored("a", 1, None, [StoredBlock(1, PROMPT[:3])], "t")
    index.apply_stored("a", 2, 999, blocks(PROMPT[4:8]), "t")
    assert index.match(PROMPT, ["a"], "t") == {}


def test_recent_placements_count_until_they_expire() -> None:
    now = [0.0]
    index = PrefixIndex(TPB, pending_ttl=5, clock=lambda: now[0])
    index.reset("a", events=True)
    assert not index.placed("a", PROMPT, "t")                 # a miss: nothing was there
    assert index.match(PROMPT, ["a"], "t") == {"a": 4}
    assert index.placed("a", PROMPT, "t")                     # a hit, as match counts it
    assert not index.placed("a", PROMPT[:4], "t")             # one token: never a reusable block
    now[0] = 6.0
    assert index.match(PROMPT, ["a"], "t") == {}


def test_history_for_replicas_without_events_evicts_least_recent_first() -> None:
    index = PrefixIndex(TPB)
    index.reset("h", events=False)
    index.set_capacity("h", 4)
    index.placed("h", PROMPT, "t")
    assert index.match(PROMPT, ["h"], "t") == {"h": 4}
    index.placed("h", [50 + i for i in range(8)], "t")        # two new blocks push two old ones out:
    assert index.match(PROMPT, ["h"], "t") == {"h": 2}        # the suffix goes first, as in the engines
    index.finished("h", PROMPT, [1, 2, 3], "t")
    assert index.match([*PROMPT, 1, 2, 3, 4], ["h"], "t") == {"h": 4}   # prompt + reply: 5 blocks, cap 4


def snap(address: str, **kw: object) -> ReplicaSnapshot:
    return ReplicaSnapshot(address, **kw)  # type: ignore[arg-type]


def held_by(address: str, prompt: list[int]) -> PrefixIndex:
    index = PrefixIndex(TPB, pending_ttl=0)
    for a in ("a", "b", "c"):
        index.reset(a, events=True)
    index.apply_stored(address, 1, None, blocks(prompt[:16]), "t")
    return index


LONG = list(range(1, 1002))


def test_the_replica_holding_the_prefix_wins_at_equal_load() -> None:
    policy = PrefixAware(held_by("b", PROMPT), PrefixWeights(load_cost=1))
    assert policy.choose([snap("a"), snap("b"), snap("c")], view(PROMPT)) == "b"


def test_a_hit_is_worth_some_load_but_not_any_load() -> None:
    index = PrefixIndex(TPB, pending_ttl=0)
    index.reset("b", events=True)
    index.apply_stored("b", 1, None, blocks(LONG), "t")        # 250 blocks = 1000 tokens cached on b
    policy = PrefixAware(index, PrefixWeights(load_cost=256, run_cost=16, balance_rel=1.25, balance_abs=2))
    # b runs 2 more requests (32 token-equivalents) but saves ~1000 tokens of prefill: b
    assert policy.choose([snap("a"), snap("b", in_flight=2)], view(LONG)) == "b"
    # b runs 3 more: beyond the balance bound (least + 2), a hit is not worth it
    assert policy.choose([snap("a"), snap("b", in_flight=3)], view(LONG)) == "a"
    # b's batch is full: the new request would wait behind 4 (1024 token-equivalents) to save ~1000
    full = snap("b", active=8, max_active=8, queued=3)
    assert policy.choose([snap("a", active=7, max_active=8), full], view(LONG)) == "a"
    # b's KV cache: a candidate only while its free blocks hold what the request still needs
    assert policy.choose([snap("a"), snap("b", kv_used=99, kv_total=100)], view(LONG)) == "b"   # 1 block left: enough
    # b cannot hold the reply (16 blocks): it would wait, worth load_cost (256) - still less than 1000 tokens
    reply = PlacementView("t", prompt_tokens=len(LONG), prompt_ids=LONG, cache_salt="t", max_tokens=64)
    assert policy.choose([snap("a"), snap("b", kv_used=90, kv_total=100)], reply) == "b"
    short = PlacementView("t", prompt_tokens=len(PROMPT), prompt_ids=PROMPT, cache_salt="t", max_tokens=64)
    assert policy.choose([snap("a"), snap("b", kv_used=90, kv_total=100)], short) == "a"   # nothing to save there


def test_without_hits_the_prefix_policy_is_least_loaded() -> None:
    policy = make_policy("prefix")
    assert policy.choose([snap("a", in_flight=2), snap("b", in_flight=1), snap("c", in_flight=3)], view(PROMPT)) == "b"
    assert policy.choose([snap("a", in_flight=2), snap("b", queued=1)], view(PROMPT)) == "a"   # b has a queue


def test_pools_restrict_every_policy() -> None:
    snaps = [snap("a", pool="default"), snap("b", pool="canary", in_flight=9)]
    for name in ("prefix", "least-loaded", "round-robin", "random", "session"):
        assert make_policy(name).choose(snaps, view(PROMPT, pool="canary")) == "b"


def test_a_saturated_sticky_replica_lets_the_session_move() -> None:
    full = snap("a", active=8, max_active=8, queued=3)
    assert saturated(full)
    v = view(PROMPT, session_id="s", sticky="a")
    assert make_policy("least-loaded").choose([full, snap("b", in_flight=1)], v) == "b"
    assert make_policy("least-loaded").choose([snap("a", in_flight=9), snap("b")], v) == "a"


def test_round_robin_cycles_and_session_only_sticks() -> None:
    snaps = [snap("a"), snap("b"), snap("c")]
    rr = RoundRobin()
    assert [rr.choose(snaps, view(PROMPT)) for _ in range(4)] == ["a", "b", "c", "a"]
    so = SessionOnly()
    assert {so.choose(snaps, view(PROMPT, session_id="s", sticky="c")) for _ in range(3)} == {"c"}
