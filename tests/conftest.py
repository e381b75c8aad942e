"""Shared fixtures: locating ../shared/data, free ports, a real redis-server; the test process's GC."""

from __future__ import annotations

import gc
from collections.abc import Iterator

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


@pytest.fixture(autouse=True, scope="module")
def _old_objects_out_of_gc() -> Iterator[None]:
    """What earlier test modules left alive is moved out of the collector's sight (`gc.freeze`)
    before each module, its cyclic garbage collected first. Without it this process's full
    collections scanned ~600k objects (tokenizers, models, earlier tests' state) and held it for
    0.36-0.7 s each (96 pauses over 20 ms in one run, measured with a `gc.callbacks` timer,
    2026-12-06): long enough, landing mid-test, to trip the router's overload guard (its admission
    calls waiting > 250 ms), which failed tests/router/test_admission_pipeline.py twice in CI. The
    services do the same once at startup (services/gcstats.py)."""
    gc.collect()
    gc.freeze()
    yield
