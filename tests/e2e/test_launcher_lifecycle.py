"""`tokenrelay up` never leaves orphan servers: SIGTERM stops it cleanly, and even kill -9 of the
launcher takes every child down with it."""

from __future__ import annotations

import signal

import psutil
import pytest

from tests.meshkit import start_mesh


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_no_orphans_after_the_launcher_stops(tmp_path, model_dir, sig):
    mesh = start_mesh(tmp_path, model_dir, "sim")
    children = psutil.Process(mesh.proc.pid).children(recursive=True)
    names = " ".join(" ".join(c.cmdline()) for c in children)
    for part in ("redis-server", "tokenizer_svc", "engine_svc", "router_svc"):
        assert part in names
    mesh.proc.send_signal(sig)
    code = mesh.proc.wait(60)
    if sig == signal.SIGTERM:
        assert code == 0, mesh.log.read_text()[-2000:]
    _, alive = psutil.wait_procs(children, timeout=30)
    assert alive == []
