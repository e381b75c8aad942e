"""Prefix-aware routing and mid-stream migration with real processes: a tokenizer, three sim
engines (paged KV cache, KV events), routers sharing one redis-server.

- follow-up turns of conversations without session ids land where their prefix is cached (the
  engines report the cached tokens), where round-robin over the same engines does not;
- a router started after the conversations began knows what the first one knows (the engines'
  snapshot on subscription) and sends a follow-up to the replica that holds it;
- an engine killed mid-stream: every stream completes, greedy output identical to an
  uninterrupted run, and each moved stream was told it migrated.
"""

from __future__ import annotations

import asyncio
import random

import pytest
import pytest_asyncio

from services.client import Client, Migrated, TextDelta
from tests.e2e.prockit import KEYS, Procs

ENGINES = 3
BLOCK = 16
# Block-sized KV pages; a step slow enough to kill an engine mid-stream, fast enough for 2 cores.
SIM = ["--sim-tokens-per-block", str(BLOCK), "--sim-num-blocks", "4096"]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def mesh(tmp_path_factory, redis_url):
    """One mesh for the module (the tests run in order; the last one kills an engine)."""
    p = Procs(tmp_path_factory.mktemp("prefix"), redis_url)
    try:
        await p.upstreams(*SIM, engines=ENGINES)
        p.router("prefix")
        p.router("rr", "--routing-policy", "round-robin")
        await p.ready("prefix", "rr")
        yield p
    finally:
        p.stop()


def _conversations(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(40, 120) for _ in range(rng.randrange(60, 120))] for _ in range(n)]


async def _turns(client: Client, firsts: list[list[int]], turns: int, rng: random.Random,
                 together: bool = True) -> list[tuple[int, int]]:
    """Each conversation: `turns` requests, each the previous prompt + reply + a new message; the
    conversations run concurrently (`together`) or one after another.
    Returns (prompt tokens, cached tokens) of every follow-up turn."""
    out: list[tuple[int, int]] = []

    async def one(prompt: list[int]) -> None:
        for turn in range(turns):
            r = await client.generate(token_ids=prompt, max_tokens=12, ignore_eos=True, return_token_ids=True)
            if turn:
                out.append((r.finished.prompt_tokens, r.finished.cached_tokens))
            prompt = [*prompt, *r.token_ids, *(rng.randrange(40, 120) for _ in range(20))]

    if together:
        await asyncio.gather(*(one(f) for f in firsts))
    else:
        for f in firsts:
            await one(f)
    return out


def _hit_rate(turns: list[tuple[int, int]]) -> float:
    return sum(c for _, c in turns) / sum(p for p, _ in turns)


pytestmark = pytest.mark.asyncio(loop_scope="module")


async def test_follow_up_turns_land_where_their_prefix_is_cached(mesh: Procs) -> None:
    rng = random.Random(3)
    async with Client(mesh.addr["prefix"], KEYS["t1"], timeout=30) as c:
        prefix = await _turns(c, _conversations(5, seed=1), 3, rng)
    # The control, one conversation at a time so that where round-robin sends each turn is fixed: every
    # request advances it by one replica, so no follow-up lands where its previous turn ran. Run
    # concurrently, the control depended on how the turns interleaved: 0.48 and 0.64 against the
    # prefix router's 0.82 and 0.81 (CI runs, 2026-12-05 and -06), and 0.67 when 6 conversations
    # advanced it in lockstep by 6 = 0 (mod 3) per round.
    async with Client(mesh.addr["rr"], KEYS["t1"], timeout=30) as c:
        rr = await _turns(c, _conversations(5, seed=2), 3, rng, together=False)
    # Every follow-up's previous prompt + reply is cached, minus the partial last block and the reply's
    # last token (never stored): the ceiling is ~(prompt - 20 new tokens - one block) / prompt.
    assert _hit_rate(prefix) > 0.6, prefix
    assert min(c for _, c in prefix) > 0, prefix          # no follow-up missed its replica
    assert max(c for _, c in rr) == 0, rr                 # without affinity, every follow-up missed


async def test_a_router_started_later_knows_what_the_engines_hold(mesh: Procs) -> None:
    rng = random.Random(5)
    firsts = _conversations(6, seed=4)
    replies: list[list[int]] = []
    async with Client(mesh.addr["prefix"], KEYS["t1"], timeout=30) as c:
        for prompt in firsts:
            r = await c.generate(token_ids=prompt, max_tokens=12, ignore_eos=True, return_token_ids=True)
            replies.append([*prompt, *r.token_ids, *(rng.randrange(40, 120) for _ in range(20))])
    mesh.router("late")
    await mesh.ready("late")
    async with Client(mesh.addr["late"], KEYS["t1"], timeout=30) as c:
        results = [await c.generate(token_ids=p, max_tokens=4, ignore_eos=True) for p in replies]
    cached = [r.finished.cached_tokens for r in results]
    assert all(c >= 60 // BLOCK * BLOCK for c in cached), cached   # at least the first prompt's full blocks


async def test_a_session_keeps_its_replica_across_a_router_restart(mesh: Procs) -> None:
    port = mesh.addr["rr"].rsplit(":", 1)[1]
    prompt = _conversations(1, seed=9)[0]
    async with Client(mesh.addr["rr"], KEYS["t1"], timeout=30) as c:
        r = await c.generate(token_ids=prompt, max_tokens=12, ignore_eos=True, return_token_ids=True,
                             session_id="s-restart")
    mesh.procs["rr"].kill()
    mesh.procs["rr"].wait(10)
    mesh.router("rr", "--routing-policy", "round-robin", port=int(port))   # no prefix knowledge at all
    await mesh.ready("rr")
    follow = [*prompt, *r.token_ids, 50, 51]
    async with Client(mesh.addr["rr"], KEYS["t1"], timeout=30) as c:
        again = await c.generate(token_ids=follow, max_tokens=4, ignore_eos=True, session_id="s-restart")
    assert again.finished.cached_tokens >= len(prompt) // BLOCK * BLOCK   # the session's replica, from Redis


async def test_an_engine_killed_mid_stream_is_migrated_and_greedy_output_is_unchanged(mesh: Procs) -> None:
    prompts = _conversations(9, seed=7)
    async with Client(mesh.addr["prefix"], KEYS["t1"], timeout=60) as c:
        reference = [await c.generate(token_ids=p, max_tokens=60, ignore_eos=True, return_token_ids=True)
                     for p in prompts]

        async def streamed(prompt: list[int]) -> tuple[list[int], int]:
            ids: list[int] = []
            moved = 0
            async for event in c.stream(token_ids=prompt, max_tokens=60, ignore_eos=True, return_token_ids=True):
                if isinstance(event, TextDelta):
                    ids.extend(event.token_ids)
                elif isinstance(event, Migrated):
                    moved = event.migrations
            return ids, moved

        tasks = [asyncio.ensure_future(streamed(p)) for p in prompts]
        await asyncio.sleep(0.25)       # every stream has started and sent some tokens (10 ms steps)
        mesh.procs["e0"].kill()
        results = await asyncio.gather(*tasks)
    assert [ids for ids, _ in results] == [r.token_ids for r in reference]
    assert any(moved for _, moved in results), "no stream was on the killed engine"
