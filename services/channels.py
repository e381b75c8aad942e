"""The one place where tokenrelay opens a gRPC channel or binds a server port.

Both take a `SecuritySettings` section and dispatch through one table each: a port on its ``mode``
(plaintext, tls, mtls), a channel on its ``channel_mode`` (``client_mode``, else ``mode``). No
other module calls ``grpc.aio.insecure_channel`` / ``secure_channel`` or ``add_insecure_port`` /
``add_secure_port`` (``tests/test_channels.py`` checks it; ``bench/bench_grpc_overhead.py``, which
measures bare grpcio on purpose, is the one exception).

TLS and mTLS ports serve through ``grpc.dynamic_ssl_server_credentials``: on a new connection, at
most once per `RELOAD_CHECK` seconds, the certificate, key and CA files are looked at again, and
rotated ones (checked as at startup) serve the connections after it; a rotation that fails the
checks is logged and the files served so far stay. Channels read their files once, when opened:
a rotated client certificate reaches a channel opened after it (docs/security.md).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from services.logging import get_logger
from services.security import PLAINTEXT, SecuritySettings, check_ca_file, check_cert_file, check_key_file, check_pair

log = get_logger(__name__)
RELOAD_CHECK = 1.0

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS: Sequence[tuple[str, Any]] = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # An upstream that comes back (a restarted engine or tokenizer) is used within ~0.5 s: gRPC's
    # default reconnect backoff (1 s x1.6 up to 120 s) left it idle for seconds after it was healthy.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 500),
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


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise OSError(f"cannot read the {what} {path}: {exc.strerror or exc}") from exc


def _plaintext_channel(address: str, security: SecuritySettings,
                       options: Sequence[tuple[str, Any]]) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=list(options))


def _tls_channel(address: str, security: SecuritySettings, options: Sequence[tuple[str, Any]]) -> grpc.aio.Channel:
    roots = _read(security.ca_file, "CA file") if security.ca_file else None   # None: gRPC's default roots
    key = chain = None
    if security.channel_mode == "mtls":
        cert_file, key_file = security.client_identity
        chain, key = _read(cert_file, "client certificate"), _read(key_file, "client key")
    credentials = grpc.ssl_channel_credentials(root_certificates=roots, private_key=key, certificate_chain=chain)
    if security.server_name:
        options = [*options, ("grpc.ssl_target_name_override", security.server_name)]
    return grpc.aio.secure_channel(address, credentials, options=list(options))


def _plaintext_port(server: grpc.aio.Server, address: str, security: SecuritySettings) -> int:
    return server.add_insecure_port(address)


class ServerCertificates:
    """The certificate fetcher of a TLS port: grpc core calls it on each new connection; it answers
    None (keep serving what it has) unless the files changed since the last look, at most once per
    `RELOAD_CHECK` seconds, and the changed ones pass the startup checks."""

    def __init__(self, security: SecuritySettings) -> None:
        self.security = security
        self.require_client_auth = security.mode == "mtls"
        self._files = [security.cert_file, security.key_file] + ([security.ca_file] if self.require_client_auth else [])
        self._stamp = self._stamps()
        self.initial = self._configuration()
        self._checked = time.monotonic()
        self._refused: tuple[Any, ...] | None = None
        self.reloads = 0

    def _stamps(self) -> tuple[Any, ...]:
        out: list[tuple[int, int, int] | None] = []
        for path in self._files:
            try:
                st = os.stat(path)
                out.append((st.st_ino, st.st_size, st.st_mtime_ns))
            except OSError:
                out.append(None)
        return tuple(out)

    def _configuration(self) -> grpc.ServerCertificateConfiguration:
        s = self.security
        pair = (_read(s.key_file, "key file"), _read(s.cert_file, "certificate file"))
        roots = _read(s.ca_file, "CA file") if self.require_client_auth else None
        return grpc.ssl_server_certificate_configuration([pair], root_certificates=roots)

    def _problems(self) -> list[str]:
        s, problems = self.security, []
        checks = [(check_cert_file, s.cert_file), (check_key_file, s.key_file)]
        if self.require_client_auth:
            checks.append((check_ca_file, s.ca_file))
        for check, path in checks:
            try:
                check(path)
            except ValueError as exc:
                problems.append(str(exc))
        if not problems and (mismatch := check_pair(s.cert_file, s.key_file)):
            problems.append(mismatch)
        return problems

    def __call__(self) -> grpc.ServerCertificateConfiguration | None:
        try:
            return self._fetch()
        except Exception as exc:  # noqa: BLE001 - called from grpc core: never raise into it
            log.warning("tls_reload_failed", error=repr(exc))
            return None

    def _fetch(self) -> grpc.ServerCertificateConfiguration | None:
        now = time.monotonic()
        if now - self._checked < RELOAD_CHECK:
            return None
        self._checked = now
        stamp = self._stamps()
        if stamp == self._stamp or stamp == self._refused:
            return None
        problems = self._problems()
        if problems:   # e.g. a rotation half written: keep serving the old files, look again later
            self._refused = stamp
            log.warning("tls_reload_refused", problems=problems, cert_file=self.security.cert_file)
            return None
        config = self._configuration()
        self._stamp, self._refused = stamp, None
        self.reloads += 1
        log.info("tls_certificates_reloaded", cert_file=self.security.cert_file)
        return config


def _tls_port(server: grpc.aio.Server, address: str, security: SecuritySettings) -> int:
    fetcher = ServerCertificates(security)
    credentials = grpc.dynamic_ssl_server_credentials(
        fetcher.initial, fetcher, require_client_authentication=fetcher.require_client_auth)
    return server.add_secure_port(address, credentials)


_CHANNELS: dict[str, Callable[[str, SecuritySettings, Sequence[tuple[str, Any]]], grpc.aio.Channel]] = {
    "plaintext": _plaintext_channel,
    "tls": _tls_channel,
    "mtls": _tls_channel,
}
_PORTS: dict[str, Callable[[grpc.aio.Server, str, SecuritySettings], int]] = {
    "plaintext": _plaintext_port,
    "tls": _tls_port,
    "mtls": _tls_port,
}


def _handler(table: dict[str, Any], mode: str) -> Any:
    handler = table.get(mode)
    if handler is None:
        raise UnknownSecurityMode(
            f"unknown transport security mode {mode!r} (this build supports: {', '.join(sorted(table))})")
    return handler


def open_channel(address: str, security: SecuritySettings = PLAINTEXT, *,
                 options: Sequence[tuple[str, Any]] = CHANNEL_OPTIONS) -> grpc.aio.Channel:
    """An asyncio channel to ``host:port`` secured as ``security``'s channel side says (plaintext by
    default). Raises OSError when a certificate file cannot be read."""
    return _handler(_CHANNELS, security.channel_mode)(address, security, options)  # type: ignore[no-any-return]


def bind_port(server: grpc.aio.Server, address: str, security: SecuritySettings = PLAINTEXT) -> int:
    """Bind ``host:port`` (port 0 = ephemeral) on ``server``; returns the bound port.

    Raises OSError when the address cannot be bound (grpcio reports that as port 0 or RuntimeError,
    depending on its version) or a certificate file cannot be read.
    """
    bind = _handler(_PORTS, security.mode)
    try:
        port = int(bind(server, address, security))
    except RuntimeError as exc:
        raise OSError(f"could not bind {address}: {exc}") from exc
    if port == 0:
        raise OSError(f"could not bind {address}")
    return port
