"""services.loopidle: the share of time an asyncio loop waits in its selector, and the mux's use of it
(a loop that never waits is saturated whatever CPU share its process gets)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

import services.mux as mux
from services.loopidle import idle_seconds


async def test_an_idle_loop_counts_its_waits_and_a_busy_one_does_not() -> None:
    loop = asyncio.get_running_loop()
    start = idle_seconds(loop)
    assert start is not None
    t0 = time.perf_counter()
    await asyncio.sleep(0.2)                      # waiting in the selector
    waited = idle_seconds(loop) - start           # type: ignore[operator]
    assert 0.15 <= waited <= time.perf_counter() - t0 + 0.01
    before = idle_seconds(loop)
    spin_until = time.perf_counter() + 0.2
    while time.perf_counter() < spin_until:       # busy: every turn has work ready
        await asyncio.sleep(0)
    assert idle_seconds(loop) - before < 0.05     # type: ignore[operator]
    # the metered selector still does the selector's other work (register / unregister)
    reader, writer = await asyncio.open_connection(*(await _echo()).sockets[0].getsockname())
    writer.write(b"x")
    assert await reader.readexactly(1) == b"x"
    writer.close()


async def _echo() -> asyncio.Server:
    async def echo(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(await r.readexactly(1))
        await w.drain()
        w.close()
    return await asyncio.start_server(echo, "127.0.0.1", 0)


def test_a_loop_without_a_selector_cannot_be_metered() -> None:
    class NoSelector:
        pass
    assert idle_seconds(NoSelector()) is None     # type: ignore[arg-type]


class _FakeLoop:
    def __init__(self) -> None:
        self.now = 100.0

    def time(self) -> float:
        return self.now

    def call_soon(self, *args: Any) -> None:
        pass


@pytest.mark.parametrize("cpu_per_window,saturated", [(0.059, True), (0.02, False)])
def test_without_a_meter_the_waker_falls_back_to_the_loop_threads_cpu_time(
        monkeypatch: pytest.MonkeyPatch, cpu_per_window: float, saturated: bool) -> None:
    cpu = iter(i * cpu_per_window for i in range(10))
    monkeypatch.setattr(mux, "idle_seconds", lambda loop: None)
    monkeypatch.setattr(mux.time, "thread_time", lambda: next(cpu))
    waker, loop = mux._Waker(0.02), _FakeLoop()
    for _ in range(3):
        waker._probed(loop, loop.now)             # type: ignore[arg-type]  # a probe with no lag
        loop.now += 0.06
    assert waker.saturated is saturated and waker.behind is saturated
