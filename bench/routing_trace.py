"""Traces of bench_routing.py: closed-loop multi-turn conversations, deterministic from a seed.

A trace is a list of conversation scripts; the prompts are assembled while the bench runs, because
each turn resends the whole conversation and the assistant's earlier replies in it are the tokens
the engine actually returned (so that a replica that cached a reply can serve it from its cache):

    prompt(turn t) = prefix + Σ_{i<t} (USER + user_i + ASSISTANT + reply_i + END) + USER + user_t + ASSISTANT

`prefix` is the conversation's system prompt, or a shared one, or the hot conversation's history.
Prompt ids are ASCII bytes (4-127; 1-3 are the turn markers) of the router's tokenizer
(`tokenrelay_tools/cli/byte_tokenizer.py`); replies are whatever the sims draw (ids below 259).
No trace carries session ids (the `session` policy run adds them).

Traces (`build(name, seed)`):
  chat-multiturn   independent conversations: each its own system prompt (160-480 tokens), 3-6
                   turns of 20-160 user tokens, replies of 32-96 tokens; no prefix is shared.
  shared-hot       a few shared system prompts and one hot conversation: half the conversations
                   continue the same ~1.6k-token conversation (many clients asking follow-ups of
                   one thread: a cache-chaser sends them all to the one replica that holds it);
                   the others start from one of 3 shared system prompts (320-800 tokens).
  evict            chat-multiturn's shape with longer histories (up to ~2.6k tokens), meant for
                   replicas with few KV blocks (96 of 32 tokens: two such conversations overflow one)
                   and run at twice the concurrency (bench_routing.py --evict-concurrency, 16: two
                   conversations per replica, so that where they land decides what is evicted).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

USER, ASSISTANT, END = 1, 2, 3      # turn markers (control bytes)
VOCAB = 128                          # ids are ASCII bytes: one character each, valid UTF-8 alone
TRACES = ("chat-multiturn", "shared-hot", "evict")


@dataclass(frozen=True)
class Conversation:
    cid: int
    kind: str                                 # "own", "sys<k>" or "hot"
    prefix: tuple[int, ...]
    users: tuple[tuple[int, ...], ...]        # one user message per turn
    max_tokens: tuple[int, ...]               # reply length per turn (ignore_eos: exact)

    @property
    def turns(self) -> int:
        return len(self.users)


@dataclass(frozen=True)
class Trace:
    name: str
    seed: int
    conversations: tuple[Conversation, ...]
    concurrency: int = 8

    @property
    def requests(self) -> int:
        return sum(c.turns for c in self.conversations)


def _tokens(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(4, VOCAB) for _ in range(n))


def prompt(conv: Conversation, replies: Sequence[Sequence[int]], turn: int, lead: Sequence[int] = ()) -> list[int]:
    """The ids sent for `turn` (0-based), given the engine's replies to the earlier turns. `lead`
    (the bench's per-run tokens) goes first, so that runs sharing replicas never share a block."""
    if len(replies) < turn:
        raise ValueError(f"turn {turn} needs {turn} earlier replies, got {len(replies)}")
    ids = [*lead, *conv.prefix]
    for i in range(turn):
        ids += [USER, *conv.users[i], ASSISTANT, *replies[i], END]
    ids += [USER, *conv.users[turn], ASSISTANT]
    return ids


def length_bound(conv: Conversation, lead: int = 0) -> int:
    """Tokens of the last turn's prompt plus its reply: the most one request of it holds."""
    return lead + len(conv.prefix) + sum(len(u) + m + 3 for u, m in zip(conv.users, conv.max_tokens, strict=True))


def _conversation(rng: random.Random, cid: int, kind: str, prefix: tuple[int, ...], turns: int,
                  user: tuple[int, int], reply: tuple[int, int], budget: int) -> Conversation:
    users: list[tuple[int, ...]] = []
    lengths: list[int] = []
    total = len(prefix)
    for _ in range(turns):
        u, m = rng.randint(*user), rng.randint(*reply)
        if users and total + u + m + 3 > budget:
            break
        users.append(_tokens(rng, u))
        lengths.append(m)
        total += u + m + 3
    return Conversation(cid, kind, prefix, tuple(users), tuple(lengths))


def build(name: str, seed: int = 0, conversations: int = 32, concurrency: int = 8) -> Trace:
    rng = random.Random(f"{name}:{seed}")
    convs: list[Conversation] = []
    if name in ("chat-multiturn", "evict"):
        long = name == "evict"
        for cid in range(conversations):
            system = _tokens(rng, rng.randint(*((320, 640) if long else (160, 480))))
            convs.append(_conversation(rng, cid, "own", system, rng.randint(*((4, 7) if long else (3, 6))),
                                       (60, 200) if long else (20, 160), (48, 96) if long else (32, 96),
                                       2600 if long else 4000))
    elif name == "shared-hot":
        systems = [_tokens(rng, n) for n in (320, 560, 800)]
        hot = list(systems[0])
        for _ in range(4):   # the hot thread's history: fixed turns, cached as prompt tokens
            hot += [USER, *_tokens(rng, 120), ASSISTANT, *_tokens(rng, 160), END]
        for cid in range(conversations):
            if rng.random() < 0.5:
                convs.append(_conversation(rng, cid, "hot", tuple(hot), rng.randint(2, 4), (16, 64), (32, 64), 4000))
            else:
                k = rng.randrange(len(systems))
                convs.append(_conversation(rng, cid, f"sys{k}", systems[k], rng.randint(3, 5), (20, 120),
                                           (32, 96), 4000))
    else:
        raise ValueError(f"unknown trace {name!r} (known: {', '.join(TRACES)})")
    return Trace(name, seed, tuple(convs), concurrency)
