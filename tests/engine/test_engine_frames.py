"""The engine's frame port (engine_svc --frame-port, services/frames.py): the routers' stream without
gRPC. A real engine server in process (gRPC and the frame port on loopback) and the router's
`EnginePool` as its client: the port is told in load polls, requests run over it, a lost connection
aborts its requests, a port that does not answer falls back to gRPC, and secured channels never use it."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest
from pydantic import ValidationError

from engine_svc.app import start_engine
from engine_svc.config import EngineSettings
from router_svc import metrics
from router_svc.types import Sampling
from router_svc.upstreams import EnginePool, EngineReplica, frame_host
from services.channels import open_channel
from services.frames import ERROR, MAGIC, MESSAGE, FrameCall, frame, read_frame
from services.mux import StreamBroken
from services.proto.tokenrelay.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from tests.engine.conftest import FAST
from tests.waiting import poll


@pytest.fixture
async def engine_server() -> AsyncIterator[tuple]:
    engine, server = await start_engine(EngineSettings(**{**FAST, "sim_profile": "additive",
                                                          "sim_decode_step_time": 0.002, "frame_port": 0}))
    try:
        yield engine, server
    finally:
        await server.stop(0)
        await engine.close()


async def _frame_port(address: str) -> int:
    channel = open_channel(address)
    try:
        report = await engine_pb2_grpc.EngineStub(channel).GetLoad(engine_pb2.LoadRequest())
        return report.frame_port
    finally:
        await channel.close()


async def test_the_frame_port_is_told_in_load_polls_and_serves_the_stream(engine_server) -> None:
    engine, server = engine_server
    port = await _frame_port(server.address)
    assert port > 0

    async def submit() -> AsyncIterator[engine_pb2.EngineInbound]:
        yield engine_pb2.EngineInbound(submit=[engine_pb2.EngineRequest(
            request_id="r1", prompt_token_ids=[1, 2, 3], sampling=common_pb2.SamplingParams(max_tokens=5,
                                                                                           ignore_eos=True))])

    call = FrameCall("127.0.0.1", port, submit(), engine_pb2.EngineOutbound.FromString)
    tokens: list[int] = []
    finished = False
    async for message in call:     # the stream ends by itself: half-closed, its request done
        for c in message.chunks:
            tokens += c.token_ids
            finished = finished or c.finished
    assert len(tokens) == 5 and finished and engine.live == 0


async def test_a_lost_connection_aborts_its_requests(engine_server) -> None:
    engine, server = engine_server
    port = await _frame_port(server.address)
    hold = asyncio.Event()

    async def submit() -> AsyncIterator[engine_pb2.EngineInbound]:
        yield engine_pb2.EngineInbound(submit=[engine_pb2.EngineRequest(
            request_id="long", prompt_token_ids=[1, 2], sampling=common_pb2.SamplingParams(max_tokens=500,
                                                                                          ignore_eos=True))])
        await hold.wait()

    call = FrameCall("127.0.0.1", port, submit(), engine_pb2.EngineOutbound.FromString)
    it = aiter(call)
    while not any(c.token_ids for c in (await asyncio.wait_for(anext(it), 5)).chunks):
        pass
    assert engine.live == 1
    call.cancel()                 # the router went away: nothing half-closed
    await poll(lambda: engine.live == 0, timeout=5, what="the request aborted")


async def test_a_malformed_frame_ends_the_stream_with_its_reason_and_aborts_its_requests(engine_server) -> None:
    engine, server = engine_server
    port = await _frame_port(server.address)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    request = engine_pb2.EngineInbound(submit=[engine_pb2.EngineRequest(
        request_id="x", prompt_token_ids=[1], sampling=common_pb2.SamplingParams(max_tokens=500,
                                                                                ignore_eos=True))])
    writer.write(MAGIC + frame(MESSAGE, request.SerializeToString()))
    await poll(lambda: engine.live == 1, timeout=5, what="the request running")
    writer.write(frame(MESSAGE, b"\xff\xff\xff"))
    kinds = []
    try:
        while True:
            kind, payload = await asyncio.wait_for(read_frame(reader), 5)
            kinds.append(kind)
    except asyncio.IncompleteReadError:
        pass
    writer.close()
    assert kinds[-1] == ERROR and payload.startswith(b"MALFORMED_MESSAGE\0")
    assert engine.live == 0


def _streams() -> dict[str, float]:
    """The router's engine streams opened so far, by transport."""
    return {t: metrics.ENGINE_STREAMS.labels(t)._value.get() for t in ("frames", "grpc")}


@contextlib.asynccontextmanager
async def _polled(address: str, **options: Any) -> AsyncIterator[tuple[EnginePool, EngineReplica]]:
    """The router's pool over one engine, its load polled once (the frame port learned)."""
    pool = EnginePool([address], poll_interval=3600, **options)
    try:
        await pool.poll_once()
        yield pool, pool.replicas[0]
    finally:
        await pool.close()


async def test_the_routers_pool_uses_the_frame_port_and_requests_run_over_it(engine_server) -> None:
    _engine, server = engine_server
    async with _polled(server.address) as (pool, replica):
        assert replica.frame_port > 0 and replica.transport == "frames"
        before = _streams()
        inbox = pool.submit(server.address, "a", [1, 2, 3], Sampling(max_tokens=4, ignore_eos=True), [], "", {})
        assert len(await _tokens(inbox)) == 4
        assert _streams() == {"frames": before["frames"] + 1, "grpc": before["grpc"]}
        pool.release(server.address, "a")


async def _tokens(inbox) -> list[int]:
    tokens: list[int] = []
    while True:
        for c in await asyncio.wait_for(inbox.get_ready(), 10):
            if isinstance(c, StreamBroken):
                raise c.error
            tokens += c.token_ids
            if c.finished:
                return tokens


async def test_with_frames_off_the_pool_keeps_grpc(engine_server) -> None:
    # (secured engine channels: tests/test_tls.py, test_an_engine_frame_port_is_plaintext_only)
    _engine, server = engine_server
    async with _polled(server.address, frames=False) as (pool, replica):
        assert replica.frame_port == 0 and replica.transport == "grpc"
        before = _streams()
        inbox = pool.submit(server.address, "g", [1, 2], Sampling(max_tokens=3, ignore_eos=True), [], "", {})
        assert len(await _tokens(inbox)) == 3
        assert _streams() == {"frames": before["frames"], "grpc": before["grpc"] + 1}


async def test_a_frame_port_that_does_not_answer_falls_back_to_grpc_without_losing_the_request(engine_server) -> None:
    _engine, server = engine_server
    async with _polled(server.address) as (pool, replica):
        with socket.socket() as s:        # a port nobody listens on (an engine restarted on a new one)
            s.bind(("127.0.0.1", 0))
            replica.frame_port = s.getsockname()[1]
        assert replica.transport == "frames"
        before = _streams()
        inbox = pool.submit(server.address, "a", [1, 2], Sampling(max_tokens=3, ignore_eos=True), [], "", {})
        assert len(await _tokens(inbox)) == 3     # the stream went over gRPC instead: nothing failed
        pool.release(server.address, "a")
        assert replica.transport == "grpc" and replica.frames_off_until > 0
        assert _streams() == {"frames": before["frames"] + 1, "grpc": before["grpc"] + 1}
        await pool.poll_once()                    # the engine's own port, told again: used after the pause
        replica.frames_off_until = 0.0
        assert replica.transport == "frames"


def test_frame_port_bounds() -> None:
    assert EngineSettings(frame_port=0).frame_port == 0 and EngineSettings().frame_port == -1
    with pytest.raises(ValidationError):
        EngineSettings(frame_port=70000)


@pytest.mark.parametrize("address, host", [
    ("127.0.0.1:50051", "127.0.0.1"), ("engine-0.svc:7000", "engine-0.svc"), ("[::1]:7000", "::1"),
    ("dns:///engines:7000", ""), ("unix:/tmp/e.sock", ""), ("ipv4:10.0.0.1:1,10.0.0.2:1", ""), ("dns:e:1", ""),
])
def test_frame_host(address: str, host: str) -> None:
    assert frame_host(address) == host
