"""The one place where tokenrelay opens a gRPC channel or binds a server port.

Both take a `SecuritySettings` section and dispatch on its ``mode`` through one table each, so the
TLS and mutual-TLS modes planned for `services.security` are a new row here and nowhere else. No
other module calls ``grpc.aio.insecure_channel`` / ``secure_channel`` or ``add_insecure_port`` /
``add_secure_port`` (``tests/test_channels.py`` checks it; ``bench/bench_grpc_overhead.py``, which
measures bare grpcio on purpose, is the one exception).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import grpc

from services.security import PLAINTEXT, SecuritySettings

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS: Sequence[tuple[str, Any]] = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
)
SERVER_OPTIONS: Sequence[tuple[str, Any]] = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    # grpc core turns SO_REUSEPORT on by default on Linux, which would let a second process silently
    # share a port by mistake; a server opts in with `server_options(reuse_port=True)`.
    ("grpc.so_reuseport", 0),
)


def server_options(*, reuse_port: bool = False) -> list[tuple[str, Any]]:
    """Options of a grpc.aio server. ``reuse_port``: several processes bind one host:port
    (SO_REUSEPORT; each must ask for it, as the same user) and the kernel spreads incoming
    connections over them (a hash of the connection's addresses: one client channel stays on
    one process, many channels spread)."""
    options = [o for o in SERVER_OPTIONS if o[0] != "grpc.so_reuseport"]
    return [*options, ("grpc.so_reuseport", 1 if reuse_port else 0)]


class UnknownSecurityMode(ValueError):
    """A `SecuritySettings.mode` this build cannot open channels or bind ports for."""


def _plaintext_channel(address: str, security: SecuritySettings,
                       options: Sequence[tuple[str, Any]]) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=list(options))


def _plaintext_port(server: grpc.aio.Server, address: str, security: SecuritySettings) -> int:
    return server.add_insecure_port(address)


_CHANNELS: dict[str, Callable[[str, SecuritySettings, Sequence[tuple[str, Any]]], grpc.aio.Channel]] = {
    "plaintext": _plaintext_channel,
}
_PORTS: dict[str, Callable[[grpc.aio.Server, str, SecuritySettings], int]] = {
    "plaintext": _plaintext_port,
}


def _handler(table: dict[str, Any], security: SecuritySettings) -> Any:
    handler = table.get(security.mode)
    if handler is None:
        raise UnknownSecurityMode(
            f"unknown transport security mode {security.mode!r} (this build supports: {', '.join(sorted(table))})")
    return handler


def open_channel(address: str, security: SecuritySettings = PLAINTEXT, *,
                 options: Sequence[tuple[str, Any]] = CHANNEL_OPTIONS) -> grpc.aio.Channel:
    """An asyncio channel to ``host:port`` secured as ``security`` says (plaintext by default)."""
    return _handler(_CHANNELS, security)(address, security, options)  # type: ignore[no-any-return]


def bind_port(server: grpc.aio.Server, address: str, security: SecuritySettings = PLAINTEXT) -> int:
    """Bind ``host:port`` (port 0 = ephemeral) on ``server``; returns the bound port.

    Raises OSError when the address cannot be bound (grpcio reports that as port 0 or RuntimeError,
    depending on its version).
    """
    bind = _handler(_PORTS, security)
    try:
        port = int(bind(server, address, security))
    except RuntimeError as exc:
        raise OSError(f"could not bind {address}: {exc}") from exc
    if port == 0:
        raise OSError(f"could not bind {address}")
    return port
