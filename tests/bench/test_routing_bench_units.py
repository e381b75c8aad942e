"""bench_routing.py's pure parts: the oracle (one infinite prefix cache at block granularity) and the
trace generator (deterministic, conversations resend their whole history with the engine's replies)."""

from __future__ import annotations

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))

import routing_dump_report
import routing_oracle
import routing_trace


def test_oracle_hits_whole_cached_blocks_of_the_leading_run_only() -> None:
    cache = routing_oracle.InfiniteCache(4)
    first = list(range(10))                        # blocks [0-3] [4-7], tail 8 9
    assert cache.lookup(first) == 0
    cache.insert(first)
    assert cache.lookup([*range(8), 50, 51, 52]) == 8          # both blocks, then the new tail
    assert cache.lookup([0, 1, 2, 99, *range(4, 12)]) == 0     # first block differs: nothing after it counts
    assert cache.lookup([*range(4), 9, 9, 9, 9, 8, 9]) == 4    # a block matches only with its whole prefix
    assert cache.lookup(list(range(8))) == 4                   # the last token is always computed
    assert cache.lookup(list(range(9))) == 8


def test_oracle_hit_rate_counts_replies_only_when_asked() -> None:
    p1 = list(range(6))                  # blocks of 4: [0..3] cached after turn 1, 4 5 is a tail
    reply = [6, 7, 8, 9]
    p2 = [*p1, *reply, 10, 11, 12]       # blocks [0..3] [4..7] (4 5 + the reply's 6 7) [8..11]
    assert routing_oracle.hit_rate([(p1, reply), (p2, [])], 4) == (4, 19)
    assert routing_oracle.hit_rate([(p1, reply), (p2, [])], 4, replies=True) == (8, 19)


@pytest.mark.parametrize("name", routing_trace.TRACES)
def test_traces_are_deterministic_and_seeded(name: str) -> None:
    a, b = routing_trace.build(name, seed=3), routing_trace.build(name, seed=3)
    assert a == b
    assert routing_trace.build(name, seed=4) != a
    assert len(a.conversations) == 32 and a.concurrency == 8
    ids = {t for c in a.conversations for t in (*c.prefix, *(x for u in c.users for x in u))}
    assert max(ids) < routing_trace.VOCAB and min(ids) >= 1


def test_each_turn_resends_the_conversation_with_the_engines_replies() -> None:
    conv = routing_trace.build("chat-multiturn").conversations[0]
    replies = [[100 + i] * conv.max_tokens[i] for i in range(conv.turns)]
    lead = [1, 9, 0]
    p0 = routing_trace.prompt(conv, replies[:0], 0, lead)
    p1 = routing_trace.prompt(conv, replies[:1], 1, lead)
    assert p0 == [*lead, *conv.prefix, routing_trace.USER, *conv.users[0], routing_trace.ASSISTANT]
    assert p1[:len(p0)] == p0
    assert p1[len(p0):] == [*replies[0], routing_trace.END, routing_trace.USER, *conv.users[1], routing_trace.ASSISTANT]
    with pytest.raises(ValueError):
        routing_trace.prompt(conv, [], 1)


def test_shared_hot_shares_its_prefixes_and_evict_fits_its_replicas() -> None:
    hot = routing_trace.build("shared-hot")
    kinds = [c.kind for c in hot.conversations]
    assert 0.3 < kinds.count("hot") / len(kinds) < 0.7
    assert len({c.prefix for c in hot.conversations if c.kind == "hot"}) == 1
    assert len({c.prefix for c in hot.conversations}) == 4           # the hot thread + 3 system prompts
    own = routing_trace.build("chat-multiturn")
    assert len({c.prefix for c in own.conversations}) == len(own.conversations)
    evict = routing_trace.build("evict")
    # The last turn plus its reply fits a replica of 96 blocks of 32 tokens; two conversations do not.
    bounds = sorted(routing_trace.length_bound(c, lead=3) for c in evict.conversations)
    assert bounds[-1] <= 96 * 32 and bounds[-1] + bounds[-2] > 96 * 32


def test_dump_report_counts_conversations_in_progress_beside_each_placement() -> None:
    def row(cid: int, turn: int, replica: int, sent: float, cached: int = 0) -> dict[str, object]:
        return {"config": "p", "cid": cid, "turn": turn, "replica": replica, "sent": sent, "prompt": 100,
                "cached": cached, "error": ""}

    # A conversation is in progress from its first turn's placement to its last turn's.
    rows = [row(1, 0, 0, 0.0), row(2, 0, 0, 0.1), row(3, 0, 0, 0.2),     # the third beside two
            row(1, 1, 0, 0.3, 80),                                      # beside 2 and 3; 1 ends
            row(2, 1, 1, 0.4),                                          # 2 moves to replica 1, ends
            row(3, 1, 0, 0.5)]                                          # alone now
    (line,) = routing_dump_report.report(rows)
    assert "placed beside N in progress [(0, 1), (1, 1), (2, 1)]" in line
    assert "all requests [(0, 3), (1, 1), (2, 2)]" in line
    assert "follow-ups moved 1" in line
    assert "mean follow-up hit 0.267" in line
