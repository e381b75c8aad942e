"""services.loopidle: the share of time an asyncio loop waits in its selector, and the mux's use of it
(a loop that never waits is saturated whatever CPU share its process gets)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

import services.mux as mux
from services.loopidle import cpu_allowance, idle_seconds


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
    monkeypatch.setattr(mux.time, "process_time", lambda: 0.0)
    waker, loop = mux._Waker(0.02), _FakeLoop()
    for _ in range(3):
        waker._probed(loop, loop.now)             # type: ignore[arg-type]  # a probe with no lag
        loop.now += 0.06
    assert waker.saturated is saturated and waker.behind is saturated


@pytest.mark.parametrize("loop_share,process_share,allowance,saturated", [
    (0.76, 0.97, 1.0, True),    # pinned to one core: gRPC's threads take the rest of it (measured: 0.76)
    (0.76, 0.97, 2.0, False),   # the same with a second CPU to use: the loop had room
    (0.30, 0.97, 1.0, False),   # the core is busy with other threads, not with the loop
    (0.95, 0.95, 16.0, True),   # the loop thread alone at a whole core
])
def test_without_a_meter_a_loop_sharing_its_cpus_with_grpcs_threads_counts_as_saturated(
        monkeypatch: pytest.MonkeyPatch, loop_share: float, process_share: float, allowance: float,
        saturated: bool) -> None:
    # On the 16-core host (uvloop, router pinned to one core, 256 streams) the router sent 3 tokens per
    # client message against asyncio's 18, at 25-28k against 42-45k tokens per CPU-second: its loop
    # thread never reached 90% of the core it shares with gRPC's poller and event-engine threads.
    window = 0.06
    loop_cpu = iter(i * loop_share * window for i in range(10))
    process_cpu = iter(i * process_share * window for i in range(10))
    monkeypatch.setattr(mux, "idle_seconds", lambda loop: None)
    monkeypatch.setattr(mux, "cpu_allowance", lambda: allowance)
    monkeypatch.setattr(mux.time, "thread_time", lambda: next(loop_cpu))
    monkeypatch.setattr(mux.time, "process_time", lambda: next(process_cpu))
    waker, loop = mux._Waker(0.02), _FakeLoop()
    for _ in range(3):
        waker._probed(loop, loop.now)             # type: ignore[arg-type]
        loop.now += window
    assert waker.saturated is saturated


def test_the_cpu_allowance_is_the_affinity_capped_by_the_cgroup_quota(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
    assert cpu_allowance(tmp_path, "") == 8.0                                    # nothing to read
    (tmp_path / "kubepods/pod1").mkdir(parents=True)
    (tmp_path / "kubepods/pod1/cpu.max").write_text("150000 100000\n")
    assert cpu_allowance(tmp_path, "0::/kubepods/pod1\n") == 1.5                 # v2: a CPU limit
    (tmp_path / "kubepods/pod1/cpu.max").write_text("max 100000\n")
    assert cpu_allowance(tmp_path, "0::/kubepods/pod1\n") == 8.0                 # v2: no limit
    (tmp_path / "kubepods/pod1/cpu.max").write_text("2000000 100000\n")
    assert cpu_allowance(tmp_path, "0::/kubepods/pod1\n") == 8.0                 # a quota above the CPUs
    v1 = tmp_path / "cpu,cpuacct/docker/c1"
    v1.mkdir(parents=True)
    (v1 / "cpu.cfs_quota_us").write_text("50000\n")
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    # a hybrid host: the v2 line has no cpu.max here, the v1 cpu line does
    assert cpu_allowance(tmp_path, "0::/\n4:cpu,cpuacct:/docker/c1\n3:memory:/docker/c1\n") == 0.5
    (v1 / "cpu.cfs_quota_us").write_text("-1\n")
    assert cpu_allowance(tmp_path, "4:cpu,cpuacct:/docker/c1\n") == 8.0
