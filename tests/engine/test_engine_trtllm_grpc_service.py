"""engine_svc with `--backend trtllm-grpc` in front of a fake `TrtllmService`: tokens through the service's
own stream, and the fake server going away seen as a retryable failure and NOT_SERVING."""

from __future__ import annotations

import pytest

pytest.importorskip("smg_grpc_proto", reason="the trtllm-grpc extra (smg-grpc-proto) is not installed")

from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine_svc.app import start_engine
from engine_svc.config import EngineSettings
from services.channels import open_channel
from services.errors import Reason
from services.proto.tokenrelay.v1 import engine_pb2_grpc
from tests.engine.engine_testkit import StreamClient, engine_request, poll
from tests.fakes.trtllm_grpc_fake import FakeTrtllmService, start_fake


async def test_the_engine_service_streams_from_trtllm_serve_and_reports_it_gone() -> None:
    service = FakeTrtllmService()
    fake, address = await start_fake(service)
    settings = EngineSettings(backend="trtllm-grpc", port=0,
                              trtllm_grpc={"address": address, "health_interval": 0, "kv_events": False})
    engine, server = await start_engine(settings)
    channel = open_channel(server.address)
    try:
        health = health_pb2_grpc.HealthStub(channel)

        async def status() -> int:
            return int((await health.Check(health_pb2.HealthCheckRequest(service=""))).status)

        assert await status() == health_pb2.HealthCheckResponse.SERVING
        client = StreamClient(engine_pb2_grpc.EngineStub(channel))
        client.submit(engine_request("a", [1, 2, 3], max_tokens=4))
        await client.wait("a")
        assert client.tokens("a") == [4, 5, 6, 7] and client.last("a").finished
        assert engine.backend.model == "fake-llama-8b"

        service.step = 0.005   # a long request, then the server goes away under it
        client.submit(engine_request("b", [1], max_tokens=4000))   # 20 s at the fake's step
        await poll(lambda: client.tokens("b"), what="a first token")
        await fake.stop(0)
        await client.wait("b")
        assert client.last("b").error_reason == Reason.ENGINE_UNAVAILABLE and Reason.ENGINE_UNAVAILABLE.retryable

        async def not_serving() -> bool:
            return await status() == health_pb2.HealthCheckResponse.NOT_SERVING

        await poll(not_serving, what="NOT_SERVING")
        client.cancel()
    finally:
        await channel.close()
        await server.stop(0)
        await engine.close()
        await fake.stop(0)


async def test_a_restarted_trtllm_serve_makes_the_service_serve_again_without_a_restart() -> None:
    """With the health probe on, the server going away is UNAVAILABLE (NOT_SERVING, GetLoad says so,
    submits refused retryably), and its return on the same address is SERVING again, in place."""
    from services.proto.tokenrelay.v1 import engine_pb2

    service = FakeTrtllmService()
    fake, address = await start_fake(service)
    settings = EngineSettings(backend="trtllm-grpc", port=0, trtllm_grpc={
        "address": address, "health_interval": 0.02, "health_timeout": 0.5, "kv_events": False})
    engine, server = await start_engine(settings)
    channel = open_channel(server.address)
    again = None
    try:
        health = health_pb2_grpc.HealthStub(channel)
        stub = engine_pb2_grpc.EngineStub(channel)

        async def status() -> int:
            return int((await health.Check(health_pb2.HealthCheckRequest(service=""))).status)

        async def is_(wanted: int) -> bool:
            return await status() == wanted

        await fake.stop(0)
        await poll(lambda: is_(health_pb2.HealthCheckResponse.NOT_SERVING), what="NOT_SERVING")
        load = await stub.GetLoad(engine_pb2.LoadRequest())
        assert load.health == engine_pb2.ENGINE_HEALTH_UNAVAILABLE and load.draining
        refused = StreamClient(stub)
        refused.submit(engine_request("x", [1], max_tokens=2))
        await refused.wait("x")
        assert refused.last("x").error_reason == Reason.ENGINE_UNAVAILABLE
        refused.cancel()
        again, _ = await start_fake(FakeTrtllmService(), port=int(address.rsplit(":", 1)[1]))
        await poll(lambda: is_(health_pb2.HealthCheckResponse.SERVING), timeout=10, what="SERVING again")
        load = await stub.GetLoad(engine_pb2.LoadRequest())
        assert load.health == engine_pb2.ENGINE_HEALTH_SERVING and not load.draining
        client = StreamClient(stub)
        client.submit(engine_request("a", [1, 2, 3], max_tokens=4))
        await client.wait("a")
        assert client.tokens("a") == [4, 5, 6, 7] and client.last("a").finished
        client.cancel()
    finally:
        await channel.close()
        await server.stop(0)
        await engine.close()
        if again is not None:
            await again.stop(0)
