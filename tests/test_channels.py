"""services.channels: the one place channels are opened and ports bound, and a loopback round trip."""

from __future__ import annotations

import ast
import pathlib

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.channels import UnknownSecurityMode, bind_port, open_channel
from services.grpc_util import GrpcServer
from services.security import PLAINTEXT, SecuritySettings

REPO = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("services", "router_svc", "engine_svc", "tokenizer_svc", "tokenrelay_tools", "bench")
RAW = {"insecure_channel", "secure_channel", "add_insecure_port", "add_secure_port"}
# The channel module itself, and the benchmarks' bare-grpcio baselines (raw on purpose: the floor).
ALLOWED = {"services/channels.py", "bench/bench_grpc_overhead.py", "bench/bench_hops.py", "bench/bare_inference.py"}


def _raw_calls(path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if name in RAW:
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: {name}")
    return found


def test_only_services_channels_opens_channels_or_binds_ports():
    files = [p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")]
    assert len(files) > 20
    offenders = [hit for p in files if str(p.relative_to(REPO)) not in ALLOWED for hit in _raw_calls(p)]
    assert offenders == [], "open channels and bind ports through services.channels:\n" + "\n".join(offenders)
    # The check itself sees the calls it is meant to find.
    assert _raw_calls(REPO / "services" / "channels.py")
    assert _raw_calls(REPO / "bench" / "bench_grpc_overhead.py")


async def test_loopback_health_round_trip():
    server = GrpcServer("127.0.0.1", 0, ["tokenrelay.test.Nothing"], security=PLAINTEXT)
    await server.start()
    try:
        async with open_channel(server.address, PLAINTEXT) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            for service in ("", "tokenrelay.test.Nothing"):
                resp = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
                assert resp.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await server.stop(0)


async def test_unknown_mode_is_refused():
    # A mode a later release may add, arriving at a build that does not know it.
    future = SecuritySettings.model_construct(mode="quic")  # type: ignore[arg-type]
    with pytest.raises(UnknownSecurityMode, match=r"unknown transport security mode 'quic'.*mtls, plaintext, tls"):
        open_channel("127.0.0.1:1", future)
    server = grpc.aio.server()
    try:
        with pytest.raises(UnknownSecurityMode, match="'quic'"):
            bind_port(server, "127.0.0.1:0", future)
        with pytest.raises(UnknownSecurityMode):
            GrpcServer("127.0.0.1", 0, [], security=future)
    finally:
        await server.stop(0)


def test_settings_refuse_an_unknown_mode():
    with pytest.raises(ValueError, match="mode"):
        SecuritySettings(mode="quic")  # type: ignore[arg-type]
