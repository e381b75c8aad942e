"""Reloading the tenants file at runtime: on change (polled) and on SIGHUP; a bad edit keeps the old
registry and is logged and counted (real files in tmp_path, the loop's real signal handler)."""

from __future__ import annotations

import os
import pathlib
import signal

import pytest
from prometheus_client import REGISTRY
from structlog.testing import capture_logs

from router_svc.tenants import TenantsFileError, hash_key
from router_svc.tenants_reload import TenantsReloader
from services.errors import Unauthenticated
from tests.waiting import poll


def _tenants(*names: str, max_in_flight: int = 8) -> str:
    return "tenants:\n" + "".join(
        f"  - name: {n}\n    api_key_sha256: {hash_key('key-' + n)}\n    max_in_flight: {max_in_flight}\n"
        for n in names)


def _replace(path: pathlib.Path, body: str) -> None:
    """Write as operators should: a temporary file renamed over the old one."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(body)
    os.replace(tmp, path)


def _failures() -> float:
    return REGISTRY.get_sample_value("tokenrelay_router_tenants_reloads_total", {"outcome": "failed"}) or 0.0


@pytest.fixture
def path(tmp_path: pathlib.Path) -> pathlib.Path:
    p = tmp_path / "tenants.yaml"
    p.write_text(_tenants("a"))
    return p


async def test_reload_picks_up_a_change_and_in_flight_keep_their_tenant(path):
    reloader = TenantsReloader(path, 0)
    held = reloader.authenticate("key-a")  # as a request in flight holds it
    assert await reloader.reload() is False  # nothing changed
    _replace(path, _tenants("a", "b", max_in_flight=2))
    with capture_logs() as logs:
        assert await reloader.reload() is True
    assert reloader.authenticate("key-b").name == "b"
    assert reloader.authenticate("key-a").max_in_flight == 2
    assert held.max_in_flight == 8  # the old object is untouched
    event = next(e for e in logs if e["event"] == "tenants_reloaded")
    assert (event["tenants"], event["added"], event["removed"], event["changed"]) == (2, 1, 0, 1)
    _replace(path, _tenants("b", max_in_flight=2))
    assert await reloader.reload() is True
    with pytest.raises(Unauthenticated):
        reloader.authenticate("key-a")


async def test_same_content_is_no_reload(path):
    reloader = TenantsReloader(path, 0)
    before = reloader.registry
    _replace(path, path.read_text())  # new inode and mtime, same bytes
    with capture_logs() as logs:
        assert await reloader.reload() is False
    assert reloader.registry is before
    assert [e["event"] for e in logs] == ["tenants_unchanged"]


async def test_invalid_edit_keeps_the_old_registry_and_logs(path):
    reloader = TenantsReloader(path, 0)
    before, failures = reloader.registry, _failures()
    _replace(path, _tenants("a") + "    tokens_per_mintue: 1000\n")
    with capture_logs() as logs:
        assert await reloader.reload() is False
        assert await reloader.reload() is False  # the same bad edit is reported once, not every poll
    assert reloader.registry is before
    assert reloader.authenticate("key-a").name == "a"
    failed = [e for e in logs if e["event"] == "tenants_reload_failed"]
    assert len(failed) == 1 and failed[0]["log_level"] == "error"
    assert failed[0]["error"] == (f"{path}: tenant 'a': unknown key 'tokens_per_mintue' "
                                  "(did you mean 'tokens_per_minute'?)")
    assert _failures() == failures + 1
    path.unlink()  # a vanished file is a failed reload too, never an empty registry
    assert await reloader.reload() is False
    assert reloader.authenticate("key-a").name == "a"
    assert _failures() == failures + 2


async def test_a_change_is_picked_up_by_polling(path):
    reloader = TenantsReloader(path, 0.01)
    await reloader.start()
    try:
        _replace(path, _tenants("a", "c"))
        await poll(lambda: "c" in {t.name for t in reloader.registry.tenants}, what="polled reload")
    finally:
        await reloader.close()
    assert reloader._task is None


async def test_sighup_triggers_a_reload(path):
    reloader = TenantsReloader(path, 0)  # SIGHUP only: no polling
    await reloader.start()
    try:
        _replace(path, _tenants("a", "d"))
        os.kill(os.getpid(), signal.SIGHUP)
        await poll(lambda: reloader.attempts >= 1, what="reload on SIGHUP")
        assert reloader.authenticate("key-d").name == "d"
        # Forced: even a file whose stat looks unchanged is read again (content unchanged: no swap).
        registry = reloader.registry
        os.kill(os.getpid(), signal.SIGHUP)
        await poll(lambda: reloader.attempts >= 2, what="second reload on SIGHUP")
        assert reloader.registry is registry
    finally:
        await reloader.close()


def test_an_invalid_file_at_start_is_refused(path):
    path.write_text(_tenants("a") + "    weight: 0\n")
    with pytest.raises(TenantsFileError, match=r"tenant 'a': key 'weight': Input should be greater than 0"):
        TenantsReloader(path, 0)
    with pytest.raises(ValueError, match="interval"):
        TenantsReloader(path, -1)
