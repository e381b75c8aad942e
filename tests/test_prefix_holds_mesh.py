"""A conversation between turns keeps its replica: a new conversation arriving in the gap does not
take the slot and push the next turn off its cache. Real processes: a tokenizer, two sim engines of
one request each (`--sim-max-batch-size 1`), a router with holds (the default) and one without
(`--prefix-hold-seconds 0`, the positive control), one redis-server.

Conversation C's first turn (a shared prefix S and its own X) lands on e0. Right after it ends, a new
conversation D (S and its own Y, a long reply) arrives: e0 holds S, so without holds D goes there
and is still running when C's next turn (S + X + Z) comes; e0 is then busy (a request waiting
behind D costs `--prefix-load-cost`, 256 tokens, more than the S + X tokens e0's cache saves) and
the turn is prefilled from scratch on e1. With the hold C's first turn left on e0, D goes to e1 and
C's next turn finds e0 free with its cache. Measured on bench_routing.py's shared-hot trace before
holds: 17% of follow-up turns moved at `--prefix-balance-slack 0` (docs/routing.md, "Holds").
"""

from __future__ import annotations

import asyncio
import random

import pytest
import pytest_asyncio

from services.client import Client, TextDelta
from tests.e2e.prockit import KEYS, Procs

BLOCK = 16
SIM = ["--sim-tokens-per-block", str(BLOCK), "--sim-num-blocks", "4096", "--sim-max-batch-size", "1"]
SHARED, OWN = 160, 48        # S + X: 13 blocks cached on e0, less than one waiting request's load cost


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def mesh(tmp_path_factory, redis_url):
    p = Procs(tmp_path_factory.mktemp("holds"), redis_url)
    try:
        await p.upstreams(*SIM, engines=2)
        engines = [p.addr["e0"], p.addr["e1"]]
        p.router("held", engines=engines)
        p.router("plain", "--prefix-hold-seconds", "0", engines=engines)
        await p.ready("held", "plain")
        yield p
    finally:
        p.stop()


pytestmark = pytest.mark.asyncio(loop_scope="module")


async def _conversation_then_newcomer(mesh: Procs, router: str, seed: int) -> int:
    """The cached tokens of C's next turn."""
    rng = random.Random(seed)
    shared = [rng.randrange(40, 120) for _ in range(SHARED)]
    own, theirs = ([rng.randrange(40, 120) for _ in range(OWN)] for _ in range(2))
    async with Client(mesh.addr[router], KEYS["t1"], timeout=30) as client:
        first = await client.generate(token_ids=[*shared, *own], max_tokens=2, ignore_eos=True)
        assert first.finished.cached_tokens == 0
        newcomer = client.stream(token_ids=[*shared, *theirs], max_tokens=150, ignore_eos=True)
        try:
            async for event in newcomer:        # D is placed and running before C's next turn
                if isinstance(event, TextDelta):
                    break
            nxt = await client.generate(token_ids=[*shared, *own, 7, 8, 9, 10], max_tokens=2, ignore_eos=True)
        finally:
            await newcomer.aclose()              # cancels D
        await asyncio.sleep(0.3)                 # D's abort reaches the engine: both idle again
        return nxt.finished.cached_tokens


async def test_without_holds_a_newcomer_in_the_gap_pushes_the_next_turn_off_its_cache(mesh: Procs) -> None:
    cached = await _conversation_then_newcomer(mesh, "plain", seed=1)
    assert cached == 0, mesh.log("plain")      # the defect the holds mend, reproduced


async def test_a_held_replica_keeps_its_conversation_and_the_newcomer_goes_elsewhere(mesh: Procs) -> None:
    for seed in (2, 3):
        cached = await _conversation_then_newcomer(mesh, "held", seed=seed)
        assert cached >= SHARED + OWN - BLOCK, (seed, cached, mesh.log("held"))
