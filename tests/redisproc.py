"""A redis-server of a test's own on a unix socket, that the test may kill -9, stop, or start again on
the same socket (AOF by default, so data survives a kill -9 as a production Redis's does)."""

from __future__ import annotations

import pathlib
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator

import pytest


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
        while not self.sock.exists():
            assert self.proc.poll() is None and time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.01)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)


@pytest.fixture
def redis_proc(tmp_path: pathlib.Path) -> Iterator[RedisProc]:
    r = RedisProc(tmp_path)
    r.start()
    yield r
    if r.proc is not None and r.proc.poll() is None:
        r.proc.terminate()
        r.proc.wait(10)
