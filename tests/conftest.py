"""Shared fixtures: locating ../shared/data, free ports, a real redis-server."""

from __future__ import annotations

import pytest

from services.redis_client import unix_socket_listening
from tests.data import SHARED_DATA, shared_path  # noqa: F401 - re-exported for test modules
from tests.redisproc import redis_proc  # noqa: F401 - a restartable redis-server of a test's own


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory):
    """A real redis-server on a private unix socket (no TCP port at all), stopped at the end."""
    import shutil
    import subprocess
    import time

    server = shutil.which("redis-server")
    if server is None:
        pytest.fail("redis-server is required (apt-get install -y redis-server); .ci/run installs it")
    tmp = tmp_path_factory.mktemp("redis")
    sock = tmp / "redis.sock"
    proc = subprocess.Popen([server, "--port", "0", "--unixsocket", str(sock), "--save", "", "--appendonly", "no",
                             "--dir", str(tmp)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while not unix_socket_listening(sock):
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail("redis-server did not start")
        time.sleep(0.01)
    yield f"unix://{sock}"
    proc.terminate()
    proc.wait(10)
