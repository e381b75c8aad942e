"""A redis-server of a test's own on a unix socket, that the test may kill -9, stop, or start again on
the same socket (AOF by default, so data survives a kill -9 as a production Redis's does)."""

from __future__ import annotations

import pathlib
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator

import pytest

from services.redis_client import unix_socket_listening


class RedisProc:
    """redis-server on a unix socket that a test may kill -9 and start again on the same socket."""

    def __init__(self, tmp: pathlib.Path, appendonly: bool = True, fsync: str = "always") -> None:
        self.dir = tmp
        self.persist = ["--appendonly", "yes" if appendonly else "no", "--appendfsync", fsync]
        self.sock = tmp / "redis.sock"
        self.url = f"unix://{self.sock}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        server = shutil.which("redis-server")
        if server is None:
            pytest.fail("redis-server is required")
        self.sock.unlink(missing_ok=True)
        self.proc = subprocess.Popen([server, "--port", "0", "--unixsocket", str(self.sock), "--save", "",
                                      *self.persist, "--dir", str(self.dir)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while not unix_socket_listening(self.sock):
            assert self.proc.poll() is None and time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.01)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)


class TlsRedisProc(RedisProc):
    """redis-server listening only on a TLS port of 127.0.0.1 (no plaintext port, no unix socket),
    requiring a password and, with ``auth_clients``, a client certificate signed by ``ca``."""

    def __init__(self, tmp: pathlib.Path, cert: pathlib.Path, key: pathlib.Path, ca: pathlib.Path, password: str,
                 *, auth_clients: bool = True) -> None:
        super().__init__(tmp, appendonly=False)
        self.tls = ["--tls-cert-file", str(cert), "--tls-key-file", str(key), "--tls-ca-cert-file", str(ca),
                    "--tls-auth-clients", "yes" if auth_clients else "no", "--requirepass", password]
        self.port = 0
        self.url = ""

    def start(self) -> None:
        server = shutil.which("redis-server")
        if server is None:
            pytest.fail("redis-server is required")
        with socket.socket() as s:   # a free port for redis to bind (it cannot report an ephemeral TLS port)
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"rediss://127.0.0.1:{self.port}/0"
        self.proc = subprocess.Popen([server, "--port", "0", "--bind", "127.0.0.1", "--tls-port", str(self.port),
                                      "--save", "", *self.persist, "--dir", str(self.dir), *self.tls],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            assert self.proc.poll() is None and time.monotonic() < deadline, "redis-server (TLS) did not start"
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.01)


@pytest.fixture
def redis_proc(tmp_path: pathlib.Path) -> Iterator[RedisProc]:
    r = RedisProc(tmp_path)
    r.start()
    yield r
    if r.proc is not None and r.proc.poll() is None:
        r.proc.terminate()
        r.proc.wait(10)
