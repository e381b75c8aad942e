"""Engine pools with real processes: two routers sharing a redis-server, a tokenizer and three sim
engines in three pools — `default`, `canary` (a visibly different model: it answers every token with the
first EOS id, 256, which `ignore_eos` requests carry on past) and `mirror` (identical to default).

The sim's greedy tokens are a pure function of the prompt (engine_svc/backends/sim.py), so the
test knows which pool answered every request from its tokens:
- a 90/10 split holds within 2% over 2,000 requests through both routers and every session's
  requests land in one pool (the engines' own counters agree);
- `tokenrelay split set` changes both routers' split at runtime, without a restart;
- shadow mode at fraction 1: the client's tokens are exactly the primary's, the shadow engine got
  every request, and the routers record divergence 0 against the identical pool and a divergence
  for every request against the different one, whose tokens never reach the client.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections import Counter

import pytest

from engine_svc.backends.sim import context_state, mix64
from engine_svc.config import EngineSettings
from router_svc.cluster_redis import open_redis
from router_svc.pools import reset_split, write_split
from services.channels import open_channel
from services.client import Client
from services.config import load_settings
from services.proto.tokenrelay.v1 import engine_pb2, engine_pb2_grpc
from tests.e2e.prockit import KEYS, Procs
from tests.meshkit import scrape
from tests.waiting import poll
from tokenrelay_tools.cli.launcher import engine_args_for

SPLIT = "default=90,canary=10"
EOS = 256   # the byte tokenizer's first EOS id: every token canary sends




def _tokens(prompt: list[int], n: int, ids: tuple[int, int] | None) -> list[int]:
    """The sim's greedy answer (its next_token with no seed and no EOS) over `ids` (first, count);
    canary's (None) is all EOS."""
    if ids is None:
        return [EOS] * n
    first, count = ids
    state, out = context_state(prompt), []
    for _ in range(n):
        out.append(first + mix64(state) % count)
        state = context_state(out[-1:], state)
    return out


def _sim_ids(flags: list[str]) -> tuple[int, int]:
    """The ids the sim generates with these flags, as the engine parses them: (first, count)."""
    first, below = load_settings(EngineSettings, ["--backend", "sim", *flags]).sim.sample_range()
    return first, below - first


class Mesh:
    def __init__(self, procs: Procs, ids: tuple[int, int]) -> None:
        self.p = procs
        self.vocab: dict[str, tuple[int, int] | None] = {"default": ids, "mirror": ids, "canary": None}

    def prompt(self, i: int) -> list[int]:
        """A prompt whose first greedy token on default is not canary's EOS (deterministic)."""
        salt = 0
        while True:
            prompt = [32 + (i * 7 + salt) % 90, 33 + (i // 90) % 90, 34 + salt % 90, 35 + i % 17]
            if _tokens(prompt, 1, self.vocab["default"]) != _tokens(prompt, 1, self.vocab["canary"]):
                return prompt
            salt += 1

    def pool_of(self, prompt: list[int], got: list[int]) -> str:
        for pool in ("default", "canary"):
            if got == _tokens(prompt, len(got), self.vocab[pool]):
                return pool
        raise AssertionError(f"tokens {got} are neither pool's answer to {prompt}")

    async def store(self, weights: dict[str, float] | None, shadow: tuple[str, float] | None = None) -> int:
        """What `tokenrelay split set` does, in process (a CLI start costs seconds on a loaded box)."""
        redis = open_redis(self.p.redis_url, 2.0)
        try:
            if weights is None and shadow is None:
                await reset_split(redis, self.p.pool)
                return 0
            return await write_split(redis, self.p.pool, weights, shadow=shadow)
        finally:
            await redis.aclose()

    def split(self, *args: str) -> int:
        """`tokenrelay split ARGS` against the routers' Redis; the version stored (0 = none)."""
        r = subprocess.run([sys.executable, "-m", "tokenrelay_tools.cli.main", "split", *args,
                            "--redis-url", self.p.redis_url, "--pool", self.p.pool],
                           capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stderr
        return int(json.loads(r.stdout).get("version", 0))

    def metric(self, name: str, router: str = "", **labels: str) -> float:
        """A metric's sum over both routers (or one), over the samples that carry `labels`."""
        want = set(labels.items())
        return sum(v for name_ in ([router] if router else ["ra", "rb"])
                   for (n, ls), v in scrape(self.p.metrics[name_]).items() if n == name and want <= ls)

    async def serving(self, version: int) -> None:
        """Wait until both routers serve this split version."""
        await poll(lambda: all(self.metric("tokenrelay_router_split_version", r) == version for r in ("ra", "rb")),
                   timeout=10, what=f"both routers to serve split version {version}")


async def _generated(address: str) -> int:
    async with open_channel(address) as channel:
        load = await engine_pb2_grpc.EngineStub(channel).GetLoad(engine_pb2.LoadRequest(), timeout=5)
        return int(load.generated_tokens_total)


async def _counters(m: Mesh) -> dict[str, int]:
    names = {"default": "e0", "canary": "e1", "mirror": "e2"}
    values = await asyncio.gather(*(_generated(m.p.addr[n]) for n in names.values()))
    return dict(zip(names, values, strict=True))


async def _ask(m: Mesh, requests: list[tuple[int, str]], max_tokens: int, concurrency: int = 32,
               other_router: bool = False) -> list[str]:
    """Each (prompt index, session) through ra and rb alternately (`other_router`: the other way
    round); the pool that answered each."""
    out: list[str] = [""] * len(requests)
    gate = asyncio.Semaphore(concurrency)
    async with Client(m.p.addr["ra"], KEYS["t1"]) as a, Client(m.p.addr["rb"], KEYS["t1"]) as b:
        async def one(n: int, index: int, session: str) -> None:
            prompt = m.prompt(index)
            async with gate:
                done = await (a if (n + other_router) % 2 else b).generate(
                    token_ids=prompt, max_tokens=max_tokens, ignore_eos=True, session_id=session,
                    return_token_ids=True)
            out[n] = m.pool_of(prompt, list(done.token_ids))
        await asyncio.gather(*(one(n, i, s) for n, (i, s) in enumerate(requests)))
    return out


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, redis_url):
    p = Procs(tmp_path_factory.mktemp("pools"), redis_url)
    ids = _sim_ids(engine_args_for(p.model, "sim"))
    try:
        p.spawn("tok", "tokenizer_svc", "--tokenizer", str(p.model))
        base = ["--backend", "sim", "--model", str(p.model), *engine_args_for(p.model, "sim"),
                "--sim-profile", "instant"]
        p.spawn("e0", "engine_svc", *base)
        p.spawn("e1", "engine_svc", *base, "--sim-eos-probability", "1")
        p.spawn("e2", "engine_svc", *base)
        asyncio.run(p.ready("tok", "e0", "e1", "e2"))
        engines = f"{p.addr['e0']},canary@{p.addr['e1']},mirror@{p.addr['e2']}"
        for name in ("ra", "rb"):
            p.spawn(name, "router_svc", "--tokenizers", p.addr["tok"], "--engines", engines,
                    "--redis-url", redis_url, "--pool", p.pool, "--tenants-file", str(p.tenants),
                    "--router-id", name, "--engine-poll-interval", "0.2", "--traffic-split", SPLIT,
                    "--split-poll-interval", "5", "--max-loop-lag-ms", "0")   # a loaded CI box: no refusals
        asyncio.run(p.ready("ra", "rb"))
        yield Mesh(p, ids)
    finally:
        p.stop()


async def test_a_90_10_split_holds_within_2_percent_over_2000_requests_and_sticks_per_session(mesh):
    await mesh.serving(await mesh.store(None))            # the routers' --traffic-split
    before = await _counters(mesh)
    # 2,000 sessions, one request each through either router; then 300 of them again, each through
    # the other router than its first request.
    requests = [(i, f"s{i}") for i in range(2000)]
    t0 = time.monotonic()
    pools = await _ask(mesh, requests, max_tokens=1)
    elapsed = time.monotonic() - t0
    share = Counter(pools)["canary"] / len(pools)
    assert abs(share - 0.10) <= 0.02, share
    again = await _ask(mesh, requests[:300], max_tokens=1, other_router=True)
    assert again == pools[:300]                                   # sticky per session, across routers
    assert {"canary", "default"} <= set(again)
    after, served = await _counters(mesh), Counter(pools) + Counter(again)
    for pool in ("default", "canary"):                            # the engines' own counts agree
        assert after[pool] - before[pool] == served[pool]
    assert after["mirror"] == before["mirror"]                    # not in the split: no traffic
    assert mesh.metric("tokenrelay_router_pool_requests_total", pool="canary", how="split") >= served["canary"]
    print(f"2000 requests in {elapsed:.1f} s, canary share {share:.4f}")


async def test_split_set_changes_both_routers_at_runtime_and_rolls_back(mesh):
    await mesh.serving(await mesh.store(None))
    probe = [(i, f"s{i}") for i, pool in enumerate(await _ask(mesh, [(i, f"s{i}") for i in range(100)], 1))
             if pool == "canary"][:8]
    assert probe

    async def served(want: set[str]) -> None:   # each session through both routers
        assert set(await _ask(mesh, probe, 1)) | set(await _ask(mesh, probe, 1, other_router=True)) == want

    version = mesh.split("set", "default=100")            # instant rollback
    t0 = time.monotonic()
    await mesh.serving(version)
    print(f"rollback served by both routers {time.monotonic() - t0:.2f} s after `split set` returned")
    await served({"default"})
    await mesh.serving(await mesh.store({"default": 0, "canary": 100}))
    await served({"canary"})
    await mesh.serving(await mesh.store({"default": 90, "canary": 10}))
    await served({"canary"})                              # back to 90/10: the same sessions, the same pool


async def _greedy(mesh: Mesh, n: int, max_tokens: int, session: str) -> None:
    """`n` greedy requests through both routers: each answer is exactly default's, as without a
    shadow (not one shadow token got in: canary's are all EOS)."""
    gate = asyncio.Semaphore(8)
    async with Client(mesh.p.addr["ra"], KEYS["t2"]) as a, Client(mesh.p.addr["rb"], KEYS["t2"]) as b:
        async def one(k: int) -> None:
            prompt = mesh.prompt(3000 + k)
            async with gate:
                done = await (a if k % 2 else b).generate(token_ids=prompt, max_tokens=max_tokens, ignore_eos=True,
                                                          session_id=f"{session}{k}", return_token_ids=True)
            assert list(done.token_ids) == _tokens(prompt, max_tokens, mesh.vocab["default"])
            assert done.finished.completion_tokens == max_tokens
        await asyncio.gather(*(one(k) for k in range(n)))


async def test_shadow_answers_are_recorded_and_never_reach_the_client(mesh):
    n, max_tokens = 40, 8
    for shadow_pool, result in (("mirror", "match"), ("canary", "diverged")):
        if shadow_pool == "mirror":   # through the CLI once
            await mesh.serving(mesh.split("set", "default=100", "--shadow", f"{shadow_pool}:1"))
        else:
            await mesh.serving(await mesh.store(None, (shadow_pool, 1.0)))
        before = await _counters(mesh)
        counted = mesh.metric("tokenrelay_router_shadow_requests_total", pool=shadow_pool, result=result)
        await _greedy(mesh, n, max_tokens, session=f"sh-{shadow_pool}-")

        await poll(lambda sp=shadow_pool, r=result, c=counted: mesh.metric(
            "tokenrelay_router_shadow_requests_total", pool=sp, result=r) >= c + n, timeout=10,
            what=f"{n} shadow records ({shadow_pool})")
        after = await _counters(mesh)
        assert after[shadow_pool] - before[shadow_pool] == n * max_tokens     # the shadow engine answered all
        assert after["default"] - before["default"] == n * max_tokens
        divergence = mesh.metric("tokenrelay_router_shadow_divergence_sum", pool=shadow_pool)
        assert (divergence == 0) == (shadow_pool == "mirror"), divergence
    assert mesh.metric("tokenrelay_router_shadow_requests_total", result="error") == 0
    log = "".join((mesh.p.tmp / f"{r}.log").read_text(errors="replace") for r in ("ra", "rb"))
    assert log.count("shadow_done") >= 2 * n and "first_diff" in log
    await mesh.serving(await mesh.store({"default": 90, "canary": 10}, ("", 0.0)))
