"""Request-path defects of the old router, reproduced over real gRPC and fixed in the new core.

A real tokenizer (in-process, tiny byte-level tokenizer), a real sim engine or a fake engine
server that accepts the stream and never answers, the router's servicer on an ephemeral port
and real Redis leases (the `redis_url` fixture). Clients use raw stubs.
"""

from __future__ import annotations

import asyncio
import contextlib
import pathlib
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from engine_svc.app import start_engine
from engine_svc.config import EngineSettings
from router_svc.adapters import build_router
from router_svc.admission import Admission, AdmissionSettings
from router_svc.servicer import InferenceServicer, add_to_server
from router_svc.tenants import Tenant
from router_svc.upstreams import EnginePool, TokenizerUpstream
from services.channels import open_channel
from services.errors import REASON_KEY
from services.grpc_util import GrpcServer, wait_healthy
from services.proto.tokenrelay.v1 import common_pb2, engine_pb2, engine_pb2_grpc, inference_pb2, inference_pb2_grpc
from tests.tokenizer.tok_artefacts import build_bytelevel
from tests.waiting import poll
from tokenizer_svc.app import TokenizerApp
from tokenizer_svc.config import TokenizerSettings

TENANTS = {"key-a": Tenant(name="a", api_key_sha256="0" * 64), "key-b": Tenant(name="b", api_key_sha256="1" * 64)}


class Keys:
    def authenticate(self, api_key: str | None) -> Tenant:
        return TENANTS[api_key or "key-a"]


class MuteEngine(engine_pb2_grpc.EngineServicer):
    """Accepts the Stream, reads everything, never answers (records submits and aborts)."""

    def __init__(self) -> None:
        self.submitted: list[str] = []
        self.aborted: list[str] = []

    async def Stream(self, request_iterator: Any, context: Any) -> AsyncIterator[engine_pb2.EngineOutbound]:
        async for msg in request_iterator:
            self.submitted += [r.request_id for r in msg.submit]
            self.aborted += list(msg.abort)
        if False:  # pragma: no cover - a generator that never yields
            yield engine_pb2.EngineOutbound()

    async def GetLoad(self, request: Any, context: Any) -> engine_pb2.LoadReport:
        return engine_pb2.LoadReport(backend="mute", max_active_requests=8, max_context=4096)


def _md(key: str = "key-a") -> tuple[tuple[str, str], ...]:
    return (("x-api-key", key),)


@contextlib.asynccontextmanager
async def router_mesh(
    tmp_path: pathlib.Path, redis_url: str, *, mute: MuteEngine | None = None, with_sim: bool = False,
    sim_overrides: dict[str, Any] | None = None, **options: Any,
) -> AsyncIterator[tuple[inference_pb2_grpc.InferenceStub, Admission, Any]]:
    tok = TokenizerApp(TokenizerSettings(tokenizer=str(build_bytelevel(tmp_path / "tok")), port=0,
                                         workers=1, shutdown_grace=0.2))
    await tok.start()
    stops: list[Any] = []
    addresses: list[str] = []
    if mute is not None:
        engine_server = GrpcServer("127.0.0.1", 0, ["tokenrelay.v1.Engine"])
        engine_pb2_grpc.add_EngineServicer_to_server(mute, engine_server.server)
        await engine_server.start()
        stops.append(lambda: engine_server.stop(0))
        addresses.append(engine_server.address)
    if mute is None or with_sim:
        engine, server = await start_engine(EngineSettings(
            sim_prefill_time_per_token=0.0, sim_decode_step_time=0.01, sim_decode_time_per_seq=0.0,
            sim_vocab_size=600, sim_max_context=512, sim_eos_probability=0.0,
            **{f"sim_{k}": v for k, v in (sim_overrides or {}).items()}))
        await wait_healthy(server.address, timeout=10)
        stops += [lambda: server.stop(0), engine.close]
        addresses.append(server.address)
    admission = Admission(AdmissionSettings(redis_url=redis_url, pool=f"defects-{tmp_path.name}"))
    upstream = TokenizerUpstream([tok.address], timeout=10)
    pool = EnginePool(addresses, poll_interval=60)
    await upstream.info()
    await pool.start()
    router = build_router(upstream, pool, admission, **options)
    front = GrpcServer("127.0.0.1", 0, ["tokenrelay.v1.Inference"])
    add_to_server(InferenceServicer(router, Keys()), front.server)  # type: ignore[arg-type]
    await front.start()
    channel = open_channel(front.address)
    stub = inference_pb2_grpc.InferenceStub(channel)
    stub.channel = channel  # type: ignore[attr-defined]
    stub.address = front.address  # type: ignore[attr-defined]
    try:
        yield stub, admission, router
    finally:
        await channel.close()
        await front.stop(0)
        await pool.close()
        await upstream.close()
        for stop in stops:
            await stop()
        await admission.close()
        await tok.stop()


def _req(request_id: str, max_tokens: int = 20) -> inference_pb2.GenerateRequest:
    return inference_pb2.GenerateRequest(prompt="hello world", request_id=request_id,
                                         sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True))


async def _outcome(stub: inference_pb2_grpc.InferenceStub, req: inference_pb2.GenerateRequest,
                   key: str = "key-a", timeout: float | None = 20) -> str:
    """'done' or the reason the call ended with."""
    try:
        async for r in stub.Generate(req, metadata=_md(key), timeout=timeout):
            if r.WhichOneof("event") == "done":
                return "done"
    except grpc.aio.AioRpcError as exc:
        return dict(exc.trailing_metadata() or ()).get(REASON_KEY, exc.code().name)
    return "no done"


async def test_the_same_request_id_twice_at_once_one_runs_one_is_refused(tmp_path: pathlib.Path,
                                                                         redis_url: str) -> None:
    # Old router: in 8-10 of 10 trials one hung forever and the other got INTERNAL DETOKENIZER_ERROR.
    async with router_mesh(tmp_path, redis_url) as (stub, _, _):
        for trial in range(5):
            outcomes = await asyncio.wait_for(asyncio.gather(
                _outcome(stub, _req(f"same-{trial}")), _outcome(stub, _req(f"same-{trial}"))), 30)
            assert sorted(outcomes) == ["DUPLICATE_REQUEST_ID", "done"], outcomes


async def test_another_tenants_identical_id_is_independent_and_invisible(tmp_path: pathlib.Path,
                                                                         redis_url: str) -> None:
    async with router_mesh(tmp_path, redis_url) as (stub, _, _):
        outcomes = await asyncio.wait_for(asyncio.gather(
            _outcome(stub, _req("shared"), "key-a"), _outcome(stub, _req("shared"), "key-b")), 30)
        assert outcomes == ["done", "done"]
        running = asyncio.ensure_future(_outcome(stub, _req("mine", max_tokens=300), "key-a"))
        await asyncio.sleep(0)
        for _ in range(50):   # b can never learn of, nor cancel, a's id
            r = await stub.Cancel(inference_pb2.CancelRequest(request_id="mine"), metadata=_md("key-b"))
            assert not r.cancelled
        r = await stub.Cancel(inference_pb2.CancelRequest(request_id="mine"), metadata=_md("key-a"))
        assert await running == "done"


async def test_an_engine_that_never_answers_ends_at_the_request_timeout_aborted_lease_released(
        tmp_path: pathlib.Path, redis_url: str) -> None:
    # Old router: the request stayed `accepted` for 45 s and more, holding its tenant slot.
    mute = MuteEngine()
    async with router_mesh(tmp_path, redis_url, mute=mute, request_timeout=1.0, progress_timeout=30) as (
            stub, admission, _):
        outcome = await asyncio.wait_for(_outcome(stub, _req("stuck"), timeout=None), 10)
        assert outcome == "DEADLINE_EXCEEDED"
        await poll(lambda: mute.submitted and mute.aborted == mute.submitted, what="the engine work aborted")
        assert await poll(lambda: _no_leases(admission, "a"), what="the lease released")


async def test_a_client_deadline_ends_the_request_and_releases_its_lease(tmp_path: pathlib.Path,
                                                                         redis_url: str) -> None:
    mute = MuteEngine()
    async with router_mesh(tmp_path, redis_url, mute=mute, progress_timeout=30) as (stub, admission, router):
        assert await _outcome(stub, _req("stuck"), timeout=1.0) == "DEADLINE_EXCEEDED"
        await poll(lambda: mute.submitted and mute.aborted == mute.submitted, what="the engine work aborted")
        await poll(lambda: router.in_flight == 0)
        assert await poll(lambda: _no_leases(admission, "a"), what="the lease released")


async def test_an_engine_silent_before_the_first_token_is_failed_over(tmp_path: pathlib.Path,
                                                                        redis_url: str) -> None:
    # Old router: a stopped (SIGSTOP) engine stalled its streams for as long as it was stopped.
    mute = MuteEngine()
    async with router_mesh(tmp_path, redis_url, mute=mute, with_sim=True, progress_timeout=0.5) as (stub, _, _):
        assert await asyncio.wait_for(_outcome(stub, _req("failover"), timeout=None), 10) == "done"
        assert len(mute.submitted) == 1
        await poll(lambda: mute.aborted == mute.submitted, what="the silent attempt aborted")


async def _no_leases(admission: Admission, tenant: str) -> bool:
    return await admission.in_flight(tenant) == 0


# ------------------------------------------------------------------------------------------- chat
def _start() -> bytes:
    return inference_pb2.ChatRequest(start=inference_pb2.ChatStart()).SerializeToString()


def _turn(text: str, max_tokens: int = 8) -> bytes:
    return inference_pb2.ChatRequest(turn=inference_pb2.ChatTurn(
        messages=[common_pb2.ChatMessage(role="user", content=text)],
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True))).SerializeToString()


@pytest.mark.parametrize("garbage", [b"\xff\xff\xff\xff", b"\x12\x05\x0a\x03\x12\x01\xff"],
                         ids=["corrupt-wire-format", "invalid-utf8"])
async def test_an_undecodable_chat_message_ends_the_stream_with_invalid_argument(
        tmp_path: pathlib.Path, redis_url: str, garbage: bytes) -> None:
    # Old router: such a stream hung with no status (73 of 470 fuzzed cases).
    async with router_mesh(tmp_path, redis_url) as (stub, _, _):
        channel = stub.channel  # type: ignore[attr-defined]
        chat = channel.stream_stream("/tokenrelay.v1.Inference/Chat", request_serializer=None,
                                     response_deserializer=inference_pb2.ChatResponse.FromString)

        async def send() -> AsyncIterator[bytes]:
            yield _start()
            yield garbage
            await asyncio.Event().wait()   # keep the stream open: the server must end it

        call = chat(send(), metadata=_md())
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async with asyncio.timeout(10):
                async for _ in call:
                    pass
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert dict(info.value.trailing_metadata() or ())[REASON_KEY] == "MALFORMED_MESSAGE"


async def test_a_per_turn_error_fails_that_turn_only(tmp_path: pathlib.Path, redis_url: str) -> None:
    # Old router: a second turn sent while one ran ended the whole session and the running turn.
    async with router_mesh(tmp_path, redis_url) as (stub, _, _):
        channel = stub.channel  # type: ignore[attr-defined]
        chat = channel.stream_stream("/tokenrelay.v1.Inference/Chat", request_serializer=None,
                                     response_deserializer=inference_pb2.ChatResponse.FromString)
        outbox: asyncio.Queue[bytes | None] = asyncio.Queue()
        for item in (_start(), _turn("first", max_tokens=60), _turn("second")):
            outbox.put_nowait(item)

        async def send() -> AsyncIterator[bytes]:
            while (item := await outbox.get()) is not None:
                yield item

        call = chat(send(), metadata=_md())
        seen: list[str] = []
        errors: list[inference_pb2.TurnError] = []
        async with asyncio.timeout(20):
            async for r in call:
                kind = r.WhichOneof("event")
                seen.append(kind)
                if kind == "turn_error":
                    errors.append(r.turn_error)
                if kind == "done":
                    if seen.count("done") == 1:
                        outbox.put_nowait(inference_pb2.ChatRequest(turn=inference_pb2.ChatTurn()).SerializeToString())
                        outbox.put_nowait(_turn("third"))
                    else:
                        outbox.put_nowait(None)
        assert [(e.code, e.reason, e.request_id) for e in errors] == [
            ("INVALID_ARGUMENT", "TURN_IN_PROGRESS", ""), ("INVALID_ARGUMENT", "EMPTY_PROMPT", "")]
        assert seen.count("done") == 2 and seen.count("accepted") == 2   # the first and the third turns ran


async def test_a_request_queued_inside_a_live_engine_is_not_taken_for_a_stalled_engine(
        tmp_path: pathlib.Path, redis_url: str) -> None:
    # Found by a client that stopped reading (2026-12-04): requests the engine queued behind its
    # batch for longer than the progress timeout failed with UNAVAILABLE ENGINE_STALLED while the
    # engine streamed other requests' tokens on the same stream. Here the engine runs one request at
    # a time by its KV cache (~0.6 s each) and the progress timeout is 0.3 s: the second waits its turn and is served.
    async with router_mesh(tmp_path, redis_url, progress_timeout=0.3, sim_overrides={"num_blocks": 3}) as (
            stub, _, _):
        outcomes = await asyncio.wait_for(asyncio.gather(
            *(_outcome(stub, _req(f"queued-{i}", max_tokens=60), timeout=None) for i in range(3))), 20)
        assert outcomes == ["done", "done", "done"]
