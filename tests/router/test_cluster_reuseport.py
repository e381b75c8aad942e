"""SO_REUSEPORT is opt-in: servers that ask for it share one host:port; one that does not is refused
a port already bound (grpc core would otherwise turn it on by itself on Linux)."""

from __future__ import annotations

import pytest

from services.channels import server_options
from services.grpc_util import GrpcServer


def test_reuse_port_is_off_unless_asked() -> None:
    assert ("grpc.so_reuseport", 0) in server_options()
    assert ("grpc.so_reuseport", 1) in server_options(reuse_port=True)
    assert sum(name == "grpc.so_reuseport" for name, _ in server_options(reuse_port=True)) == 1


async def test_servers_that_ask_share_one_port_and_others_are_refused() -> None:
    first = GrpcServer("127.0.0.1", 0, [], reuse_port=True)
    second = GrpcServer("127.0.0.1", first.port, [], reuse_port=True)  # the `up --routers N` recipe
    assert second.port == first.port
    await first.start()
    await second.start()
    try:
        with pytest.raises(OSError):
            GrpcServer("127.0.0.1", first.port, [])       # did not ask: refused, not silently sharing
    finally:
        await first.stop(0)
        await second.stop(0)
