"""services.eventloop: which loop a process runs on, the setting that chooses it, and the mux's busy
measure on a loop whose selector cannot be metered (uvloop)."""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time

import pytest

import services.eventloop as eventloop
import services.mux as mux
from router_svc.config import RouterSettings
from services.config import load_settings

uvloop = pytest.importorskip("uvloop")


async def _kind() -> str:
    """What the running loop is: ``uvloop`` or ``asyncio``."""
    return "uvloop" if type(asyncio.get_running_loop()).__module__.startswith("uvloop") else "asyncio"


@pytest.mark.parametrize("choice,expected", [("asyncio", "asyncio"), ("uvloop", "uvloop"), ("auto", "uvloop")])
def test_run_starts_the_chosen_loop(choice: eventloop.LoopChoice, expected: str) -> None:
    assert eventloop.resolve(choice) == expected
    assert eventloop.run(_kind(), choice) == expected


def test_without_uvloop_auto_falls_back_and_uvloop_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(eventloop, "uvloop_available", lambda: False)
    assert eventloop.run(_kind(), "auto") == "asyncio"
    main = _kind()
    with pytest.raises(eventloop.LoopUnavailable, match="uvloop is not installed"):
        eventloop.run(main, "uvloop")
    assert main.cr_frame is None      # closed, not left to warn "never awaited"


def test_the_setting_names_the_flag_and_refuses_a_missing_uvloop(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    tenants = tmp_path / "t.yaml"
    tenants.write_text("tenants: []\n")
    base = ["--tenants-file", str(tenants)]
    assert load_settings(RouterSettings, base).server.event_loop == "auto"
    assert load_settings(RouterSettings, [*base, "--event-loop", "asyncio"]).server.event_loop == "asyncio"
    monkeypatch.setenv("TOKENRELAY_EVENT_LOOP", "asyncio")           # the mesh-wide variable
    assert load_settings(RouterSettings, base).server.event_loop == "asyncio"
    monkeypatch.delenv("TOKENRELAY_EVENT_LOOP")
    monkeypatch.setattr(eventloop, "uvloop_available", lambda: False)
    with pytest.raises(SystemExit) as exited:
        load_settings(RouterSettings, [*base, "--event-loop", "uvloop"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "--event-loop" in err and "uvloop is not installed" in err and "Traceback" not in err


class _Spin(threading.Thread):
    """Burns CPU in another thread (as gRPC's poller thread does) until stopped: hashing a large
    buffer releases the GIL, so two of them burn up to two cores beside the loop."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.stop = threading.Event()

    def run(self) -> None:
        data = b"x" * (1 << 20)
        while not self.stop.is_set():
            hashlib.sha256(data)


async def _saturated_while_idle() -> bool:
    loop = asyncio.get_running_loop()
    assert mux.idle_seconds(loop) is None          # uvloop: no selector to meter
    waker = mux._Waker(0.02)
    deadline = time.perf_counter() + 0.3
    while time.perf_counter() < deadline:
        waker.probe(loop)
        await asyncio.sleep(0.005)
    return waker.saturated


def test_on_uvloop_the_waker_counts_the_loop_thread_not_other_threads() -> None:
    # An idle loop is not saturated though another thread of the process burns a core (as gRPC's
    # poller thread may): with the process's CPU time, as before, it read as saturated. A busy loop
    # reading as saturated is tests/test_loopidle.py's fake-clock test (a real one depends on the
    # CPU share this shared machine gives the test).
    spins = [_Spin(), _Spin()]
    for spin in spins:
        spin.start()
    try:
        assert eventloop.run(_saturated_while_idle(), "uvloop") is False
    finally:
        for spin in spins:
            spin.stop.set()
            spin.join()
