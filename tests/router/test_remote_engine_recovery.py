"""A remote engine (`trtllm-grpc` in front of a TrtllmService) whose server goes away and comes back,
seen through the router: while it is away its engine_svc is UNAVAILABLE and the router sends the
work to the other replica with no client error; once the server is back the same engine_svc
process (never restarted) serves again and gets work.

Real parts: an in-process tokenizer, a sim engine_svc and a trtllm-grpc engine_svc on ephemeral
ports, the fake TrtllmService on a real gRPC server (restarted on its port), the router's own
`Router` and upstream adapters; only admission is a stand-in (it always admits: no Redis here).
"""

from __future__ import annotations

import pathlib

import pytest

pytest.importorskip("smg_grpc_proto", reason="the trtllm-grpc extra (smg-grpc-proto) is not installed")

from engine_svc.app import start_engine
from engine_svc.config import EngineSettings
from router_svc.adapters import build_router
from router_svc.pipeline import Router
from router_svc.tenants import Tenant
from router_svc.types import Delta, Done, GenerateInput, Sampling
from router_svc.upstreams import EnginePool, TokenizerUpstream
from services.grpc_util import wait_healthy
from tests.fakes.trtllm_grpc_fake import FakeTrtllmService, start_fake
from tests.router.core_fakes import FakeAdmission
from tests.tokenizer.tok_artefacts import build_bytelevel
from tests.waiting import poll
from tokenizer_svc.app import TokenizerApp
from tokenizer_svc.config import TokenizerSettings

TENANT = Tenant(name="t", api_key_sha256="0" * 64)


async def _one(router: Router, rid: str) -> tuple[str, str]:
    """Run one request to its end; (the replica it ran on, its finish reason)."""
    replica, finish = "", ""
    inp = GenerateInput(Sampling(max_tokens=3, ignore_eos=True), prompt="hello", request_id=rid)
    async for event in router.generate(TENANT, inp):
        state = router.live(TENANT.name, rid)
        if isinstance(event, Delta) and state is not None:
            replica = state.replica or replica
        if isinstance(event, Done):
            finish = event.finish_reason
    return replica, finish


async def test_a_remote_engine_server_that_restarts_is_routed_around_then_served_again(tmp_path: pathlib.Path) -> None:
    tok = TokenizerApp(TokenizerSettings(tokenizer=str(build_bytelevel(tmp_path / "tok")), port=0, workers=1,
                                         shutdown_grace=0.2))
    await tok.start()
    fake, fake_address = await start_fake(FakeTrtllmService())
    port = int(fake_address.rsplit(":", 1)[1])
    sim = await start_engine(EngineSettings(backend="sim", port=0, sim_vocab_size=600, sim_max_context=4096,
                                            sim_decode_step_time=0.001, sim_prefill_time_per_token=0.0))
    remote = await start_engine(EngineSettings(backend="trtllm-grpc", port=0, trtllm_grpc={
        "address": fake_address, "health_interval": 0.02, "health_timeout": 0.5, "kv_events": False}))
    again = None
    for _, server in (sim, remote):
        await wait_healthy(server.address, timeout=10)
    upstream = TokenizerUpstream([tok.address], timeout=10)
    pool = EnginePool([sim[1].address, remote[1].address], poll_interval=0.1)
    try:
        await upstream.info()
        await pool.start()
        router = build_router(upstream, pool, FakeAdmission(), request_timeout=30, engine_attempts=2)
        by_replica = {sim[1].address: "sim", remote[1].address: "remote"}

        async def served(n: int, tag: str) -> set[str]:
            where = set()
            for i in range(n):
                replica, finish = await _one(router, f"{tag}{i}")
                assert finish in ("length", "stop"), (tag, i, finish)
                where.add(by_replica[replica])
            return where

        assert await served(6, "before") == {"sim", "remote"}
        await fake.stop(0)                       # trtllm-serve goes away
        await poll(lambda: not next(r for r in pool.replicas if r.address == remote[1].address).serving,
                   what="the router seeing the remote engine not serving")
        assert await served(6, "away") == {"sim"}   # no client error: all on the other replica
        again, _ = await start_fake(FakeTrtllmService(), port=port)   # ... and comes back on its port
        await poll(lambda: next(r for r in pool.replicas if r.address == remote[1].address).serving,
                   timeout=10, what="the same engine_svc serving again")
        assert "remote" in await served(8, "back")
        assert remote[0].backend.recoveries == 1
    finally:
        await pool.close()
        await upstream.close()
        for engine, server in (sim, remote):
            await server.stop(0)
            await engine.close()
        await tok.stop()
        for srv in (fake, again):
            if srv is not None:
                await srv.stop(0)
