"""Placements shared between router processes (router_svc/placement_share.py), real processes: a
tokenizer, three sim engines, three routers on one redis-server.

The sims prefill slowly (2 ms a token), and publish a request's KV events only when its prefill
step ends, so for ~1.3 s after router A placed a long prompt no engine event says where it went.
Router B and router C list the engines in the reverse order of A's, so on their own (no cached
prefix known, the replicas equally idle) they pick another replica than A did. A request sharing
A's prefix, sent to B 0.3 s after A's, must land where A's went (the engine reports the prefix as
cached there); the same through C, which runs with --no-share-placements, must not — the
test of what sharing adds.
"""

from __future__ import annotations

import asyncio
import random

import pytest
import pytest_asyncio

from services.client import Client
from tests.e2e.prockit import KEYS, Procs

BLOCK = 16
SIM = ["--sim-tokens-per-block", str(BLOCK), "--sim-num-blocks", "4096", "--sim-prefill-time-per-token", "0.002"]
PREFIX = 640     # tokens: a 1.3 s prefill on the sim before its events are published


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def mesh(tmp_path_factory, redis_url):
    p = Procs(tmp_path_factory.mktemp("share"), redis_url)
    try:
        await p.upstreams(*SIM, engines=3)
        engines = [p.addr[f"e{i}"] for i in range(3)]

        p.router("a", engines=engines)
        p.router("b", engines=engines[::-1])
        p.router("c", "--no-share-placements", engines=engines[::-1])
        await p.ready("a", "b", "c")
        yield p
    finally:
        p.stop()


pytestmark = pytest.mark.asyncio(loop_scope="module")


async def _follow(mesh: Procs, second: str, seed: int) -> tuple[int, int]:
    """A long prompt through router a, and 0.3 s later one sharing its prefix through `second`:
    (cached tokens of the first, of the second)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(40, 120) for _ in range(PREFIX)]
    async with Client(mesh.addr["a"], KEYS["t1"], timeout=30) as a, \
            Client(mesh.addr[second], KEYS["t1"], timeout=30) as b:
        first = asyncio.create_task(a.generate(token_ids=[*prefix, 1, 2, 3], max_tokens=4, ignore_eos=True))
        await asyncio.sleep(0.3)
        r2 = await b.generate(token_ids=[*prefix, 7, 8, 9, 10], max_tokens=4, ignore_eos=True)
        r1 = await first
    return r1.finished.cached_tokens, r2.finished.cached_tokens


async def test_a_placement_by_one_router_is_followed_by_another(mesh: Procs) -> None:
    first, second = await _follow(mesh, "b", seed=1)
    assert first == 0
    assert second >= PREFIX - BLOCK, (second, mesh.log("b"))   # on router a's replica, its prefix cached


async def test_without_sharing_the_other_router_goes_elsewhere(mesh: Procs) -> None:
    first, second = await _follow(mesh, "c", seed=2)
    assert first == 0
    assert second == 0, second          # router c did not know: another replica, the prefix prefilled again
