"""A conversation's next turn through another router finds its last turn's replica free, real
processes: a tokenizer, three sim engines of one request each (`--sim-max-batch-size 1`), two routers
sharing placements on one redis-server.

Router a lists the engines e0, e1, e2 and router b the reverse, so on equal terms they pick different
replicas. A turn through a lands on e0; the next turn, sent through b as soon as the first's `done`
arrives, shares its prefix (PREFIX tokens cached on e0). If b still counted a's ended request on e0,
e0 would look full (a request waiting behind one running costs `--prefix-load-cost`, 256 tokens,
more than the PREFIX tokens its cache saves) and b would prefill the turn elsewhere. Measured on the
`shared-hot` trace with two routers before the fix: 25-32% of follow-up turns moved, because the end
reached the other router only with the share's next tick (every 50 ms) and after the client's `done`
was written (docs/routing.md, "Several routers").
"""

from __future__ import annotations

import random

import pytest
import pytest_asyncio

from services.client import Client
from tests.e2e.prockit import KEYS, Procs

BLOCK = 16
SIM = ["--sim-tokens-per-block", str(BLOCK), "--sim-num-blocks", "4096", "--sim-max-batch-size", "1"]
PREFIX = 192     # tokens cached on e0 after the first turn: less than one waiting request's load cost


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def mesh(tmp_path_factory, redis_url):
    p = Procs(tmp_path_factory.mktemp("share-ends"), redis_url)
    try:
        await p.upstreams(*SIM, engines=3)
        engines = [p.addr[f"e{i}"] for i in range(3)]
        p.router("a", engines=engines)
        p.router("b", engines=engines[::-1])
        await p.ready("a", "b")
        yield p
    finally:
        p.stop()


pytestmark = pytest.mark.asyncio(loop_scope="module")


async def test_the_next_turn_through_the_other_router_stays_on_the_replica_its_last_turn_left(mesh: Procs) -> None:
    cached = []
    async with Client(mesh.addr["a"], KEYS["t1"], timeout=30) as a, \
            Client(mesh.addr["b"], KEYS["t1"], timeout=30) as b:
        for seed in range(4):     # by luck, one stale count in 4 could still be fresh in time
            rng = random.Random(seed)
            prefix = [rng.randrange(40, 120) for _ in range(PREFIX)]
            first = await a.generate(token_ids=[*prefix, 1, 2, 3], max_tokens=2, ignore_eos=True)
            assert first.finished.cached_tokens == 0
            second = await b.generate(token_ids=[*prefix, 7, 8, 9, 10], max_tokens=2, ignore_eos=True)
            cached.append(second.finished.cached_tokens)
    assert all(c >= PREFIX - BLOCK for c in cached), (cached, mesh.log("b"))
