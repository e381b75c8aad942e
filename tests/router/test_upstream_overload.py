"""Overloads of the tokenizer service reach the router's caller as UNAVAILABLE with a retry-after.

A real tokenizer (in-process, tiny tokenizer) and a real sim engine on ephemeral ports, the
router's own `Router` and upstream adapters between them; only admission is a stand-in (it
always admits), so no Redis is needed.
"""

from __future__ import annotations

import asyncio
import contextlib
import pathlib
import threading
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from engine_svc.app import start_engine
from engine_svc.config import EngineSettings
from router_svc.adapters import build_router
from router_svc.pipeline import Router
from router_svc.tenants import Tenant
from router_svc.types import Delta, Done, GenerateInput, Sampling
from router_svc.upstreams import EnginePool, TokenizerUpstream
from services.errors import TokenrelayError
from services.grpc_util import wait_healthy
from tests.router.core_fakes import FakeAdmission
from tests.tokenizer.tok_artefacts import build_bytelevel
from tests.waiting import poll
from tokenizer_svc.app import TokenizerApp
from tokenizer_svc.config import TokenizerSettings

TENANT = Tenant(name="t", api_key_sha256="0" * 64)


@contextlib.asynccontextmanager
async def mesh(tmp_path: pathlib.Path, engines: tuple[dict[str, Any], ...] = ({},), engine_attempts: int = 2,
               **tokenizer: Any) -> AsyncIterator[tuple[Router, TokenizerApp]]:
    tok = TokenizerApp(TokenizerSettings(tokenizer=str(build_bytelevel(tmp_path / "tok")), port=0,
                                         **{"workers": 1, "shutdown_grace": 0.2, **tokenizer}))
    await tok.start()
    # Slow decode steps: the first request is still open on the detokenizer when the second comes.
    started = [await start_engine(EngineSettings(**{
        "sim_prefill_time_per_token": 0.0, "sim_decode_step_time": 0.02, "sim_decode_time_per_seq": 0.0,
        "sim_vocab_size": 600, "sim_max_context": 512, "sim_eos_probability": 0.0, **overrides}))
        for overrides in engines]
    for _, server in started:
        await wait_healthy(server.address, timeout=10)
    upstream = TokenizerUpstream([tok.address], timeout=10)
    pool = EnginePool([server.address for _, server in started], poll_interval=60)
    try:
        await upstream.info()
        await pool.start()
        yield build_router(upstream, pool, FakeAdmission(), request_timeout=30, engine_attempts=engine_attempts), tok
    finally:
        await pool.close()
        await upstream.close()
        for engine, server in started:
            await server.stop(0)
            await engine.close()
        await tok.stop()


def _input(request_id: str) -> GenerateInput:
    return GenerateInput(Sampling(max_tokens=200, ignore_eos=True), prompt="hello world", request_id=request_id)


async def test_a_full_detokenize_stream_is_unavailable_with_retry_after_not_internal(tmp_path: pathlib.Path) -> None:
    async with mesh(tmp_path, max_stream_requests=1) as (router, _):
        first = router.generate(TENANT, _input("first"))
        async for event in first:   # the first request holds the stream's one slot
            if isinstance(event, Delta):
                break
        with pytest.raises(TokenrelayError) as info:
            async for _ in router.generate(TENANT, _input("second")):
                pass
        await first.aclose()
    error = info.value
    assert error.code == grpc.StatusCode.UNAVAILABLE, error
    assert error.reason == "OVERLOADED"
    assert error.retry_after is not None and error.retry_after > 0


async def test_an_overloaded_tokenize_call_is_unavailable_with_retry_after(tmp_path: pathlib.Path) -> None:
    # One input may be pending on the tokenizer; the first request's is held in its worker.
    async with mesh(tmp_path, max_batch=1, max_pending=1, inline_bytes=0) as (router, tok):

        batcher = tok.encoder.batcher  # type: ignore[union-attr]
        release, entered = threading.Event(), threading.Event()
        process = batcher._process

        def gated(jobs: Any) -> Any:
            entered.set()
            release.wait(10)
            return process(jobs)

        batcher._process = gated
        first = asyncio.create_task(_drain(router.generate(TENANT, _input("first"))))
        await poll(entered.is_set)
        with pytest.raises(TokenrelayError) as info:
            await _drain(router.generate(TENANT, _input("second")))
        release.set()
        await first
    error = info.value
    assert (error.code, error.reason) == (grpc.StatusCode.UNAVAILABLE, "OVERLOADED"), error
    assert error.retry_after is not None and error.retry_after > 0


async def _drain(events: AsyncIterator[Any]) -> None:
    async for _ in events:
        pass


# Room for one request and no queue: a second request on it is refused in-band with OVERLOADED.
TINY_ENGINE = {"sim_max_batch_size": 1, "max_queued": 0}


async def _hold_first(router: Router, session_id: str) -> AsyncIterator[Any]:
    first = router.generate(TENANT, GenerateInput(Sampling(max_tokens=200, ignore_eos=True), prompt="hello",
                                                  request_id="first", session_id=session_id))
    async for event in first:   # the first request now runs on the session's replica
        if isinstance(event, Delta):
            break
    return first


async def test_an_in_band_engine_overload_is_retried_on_another_replica(tmp_path: pathlib.Path) -> None:
    async with mesh(tmp_path, engines=(TINY_ENGINE, {})) as (router, _):
        first = await _hold_first(router, "s")
        state = router.live(TENANT.name, "first")
        busy = next(r for r in router.ports.engines.pool.replicas  # type: ignore[attr-defined]
                    if state is not None and r.address == state.replica)
        # The same session goes to the same (full) replica first; the registry says OVERLOADED is
        # retryable, so the router tries the other one before any token.
        second = GenerateInput(Sampling(max_tokens=4), prompt="hello", request_id="second", session_id="s")
        events = [e async for e in router.generate(TENANT, second)]
        await first.aclose()
    assert isinstance(events[-1], Done) and events[-1].finish_reason == "length"
    assert busy is not None and busy.healthy   # busy is not broken: it stays in the pool


async def test_an_in_band_engine_overload_without_another_attempt_is_unavailable(tmp_path: pathlib.Path) -> None:
    async with mesh(tmp_path, engines=(TINY_ENGINE,)) as (router, _):
        first = await _hold_first(router, "")
        with pytest.raises(TokenrelayError) as info:
            await _drain(router.generate(TENANT, _input("second")))
        await first.aclose()
    error = info.value   # one replica only: the client hears the overload, not NO_HEALTHY_REPLICA
    assert (error.code, error.reason) == (grpc.StatusCode.UNAVAILABLE, "OVERLOADED"), error
    assert error.retry_after is not None and error.retry_after > 0
