"""Fixtures shared by the engine tests: in-process engine servers on ephemeral ports."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from engine_svc.app import start_engine
from engine_svc.config import EngineSettings
from services.channels import open_channel
from services.grpc_util import wait_healthy
from services.proto.tokenrelay.v1 import engine_pb2_grpc

# A sim engine with every cost at zero: tests measure behaviour, not simulated time.
FAST = dict(sim_profile="instant", sim_vocab_size=1000, sim_num_blocks=512, sim_tokens_per_block=4, sim_max_context=512,
            sim_max_batch_size=16)


@pytest.fixture
async def serve() -> AsyncIterator[Callable[..., Any]]:
    """Start an in-process engine server; yields a factory returning (stub, engine)."""
    running: list[Any] = []

    async def start(**overrides: Any) -> tuple[engine_pb2_grpc.EngineStub, Any]:
        settings = EngineSettings(**{**FAST, **overrides})
        engine, server = await start_engine(settings)
        channel = open_channel(server.address)
        running.append((engine, server, channel))
        await wait_healthy(server.address, timeout=10)
        return engine_pb2_grpc.EngineStub(channel), engine

    yield start
    for engine, server, channel in running:
        await channel.close()
        await server.stop(0)
        await engine.close()
