"""Fixtures of the bench tests: a real engine_svc process (sim backend) and a fake mesh, both on port 0."""

from __future__ import annotations

import asyncio
import os
import pathlib
import subprocess
import sys
from collections.abc import AsyncIterator, Callable

import pytest

from services.grpc_util import GrpcServer, wait_healthy
from services.proto.tokenrelay.v1 import inference_pb2_grpc
from tests.bench.benchkit import FakeInference, poll

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture
async def engine(tmp_path: pathlib.Path) -> AsyncIterator[Callable[..., object]]:
    procs: list[asyncio.subprocess.Process] = []

    async def start(*extra: str) -> str:
        port_file = tmp_path / f"engine{len(procs)}.port"
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "engine_svc", "--backend", "sim", "--port", "0", "--port-file", str(port_file),
            "--sim-vocab-size", "512", "--sim-max-context", "512", "--sim-decode-step-time", "0.001",
            "--log-format", "console", *extra,
            cwd=REPO, env={**os.environ}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(proc)
        port = await poll(lambda: port_file.exists() and port_file.read_text().strip(), timeout=30,
                          what="engine port file")
        address = f"127.0.0.1:{port}"
        await wait_healthy(address, timeout=30)
        return address

    yield start
    for proc in procs:
        if proc.returncode is None:
            proc.terminate()
        await proc.wait()


@pytest.fixture
async def fake_mesh() -> AsyncIterator[tuple[str, FakeInference]]:
    servicer = FakeInference()
    server = GrpcServer("127.0.0.1", 0, ["tokenrelay.v1.Inference"])
    inference_pb2_grpc.add_InferenceServicer_to_server(servicer, server.server)
    await server.start()
    try:
        yield server.address, servicer
    finally:
        await server.stop(0)
