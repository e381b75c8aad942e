"""The router's own overload gate (router_svc/overload.py): loop lag measured, in-flight bounded,
refusals decided in O(1) with a registry reason and a retry-after."""

from __future__ import annotations

import asyncio
import time

import pytest

from router_svc.overload import LoopLag, OverloadGate, arrival
from router_svc.ports import LoadGate
from services.errors import Reason, Unavailable
from tests.waiting import poll


def _sample(name: str, **labels: str) -> float:
    from prometheus_client import REGISTRY

    value = REGISTRY.get_sample_value(name, labels or None)
    return value or 0.0


async def test_loop_lag_sees_a_stall_while_it_lasts_and_after() -> None:
    lag = LoopLag(interval=0.005)
    lag.start()
    try:
        await poll(lambda: lag.samples >= 2, what="lag samples")
        assert lag.lag() < 0.05
        seen: list[float] = []

        def stall() -> None:
            time.sleep(0.15)
            seen.append(lag.lag())        # a callback running during the stall sees it already
        before = _sample("tokenrelay_router_loop_lag_seconds_count")
        asyncio.get_running_loop().call_soon(stall)
        await poll(lambda: lag.last >= 0.1, what="the stall sampled")
        assert seen and seen[0] >= 0.1
        assert lag.recent_max() >= 0.1
        assert _sample("tokenrelay_router_loop_lag_seconds_count") > before
        await poll(lambda: lag.last < 0.05, what="lag back to normal")
    finally:
        await lag.close()


async def test_in_flight_bound_refuses_with_reason_and_retry_after() -> None:
    gate = OverloadGate(max_in_flight=2, max_loop_lag=0)
    assert isinstance(gate, LoadGate)
    a, b = gate.enter(), gate.enter()
    before = _sample("tokenrelay_router_refused_total", cause="in_flight")
    took = []
    for _ in range(5):                # the fastest of five: a preemption of this process is not the gate's
        t0 = time.perf_counter()
        with pytest.raises(Unavailable) as e:
            gate.enter()
        took.append(time.perf_counter() - t0)
    assert min(took) < 0.001                                # decided in well under a millisecond
    assert e.value.reason == Reason.ROUTER_OVERLOADED and e.value.retryable
    assert e.value.retry_after is not None and e.value.retry_after > 0
    assert _sample("tokenrelay_router_refused_total", cause="in_flight") == before + 5
    assert _sample("tokenrelay_router_process_in_flight") == 2
    a.exit()
    a.exit()                                                # idempotent: counted once
    assert gate.in_flight == 1
    with gate.enter():
        assert gate.in_flight == 2
    b.exit()
    assert gate.in_flight == 0 and gate.refused == 5


def test_retry_after_is_jittered_so_a_refused_burst_does_not_return_at_once() -> None:
    gate = OverloadGate(max_in_flight=1, max_loop_lag=0)
    held = gate.enter()
    hints = []
    for _ in range(200):
        with pytest.raises(Unavailable) as e:
            gate.enter()
        assert e.value.retry_after is not None
        hints.append(e.value.retry_after)
    held.exit()
    # 50 ms base (no lag), up to +50%: spread over that range, not one value.
    assert min(hints) >= 0.05 and max(hints) <= 0.075 + 0.001
    assert len(set(hints)) > 10 and max(hints) - min(hints) > 0.015


async def test_loop_lag_bound_refuses_during_a_stall_and_admits_after() -> None:
    gate = OverloadGate(max_in_flight=0, max_loop_lag=0.05, lag=LoopLag(interval=0.005))
    gate.start()
    try:
        await poll(lambda: gate.lag.samples >= 2, what="lag samples")
        outcome: list[object] = []

        def stalled_call() -> None:
            time.sleep(0.12)               # the loop is 120 ms late: a call starting now is refused
            try:
                outcome.append(gate.enter())
            except Unavailable as exc:
                outcome.append(exc)
        asyncio.get_running_loop().call_soon(stalled_call)
        await poll(lambda: outcome, what="the stalled call")
        assert isinstance(outcome[0], Unavailable) and outcome[0].reason == Reason.ROUTER_OVERLOADED
        assert "lags" in outcome[0].message
        assert outcome[0].retry_after is not None and outcome[0].retry_after >= 0.2   # ~2x the lag
        await poll(lambda: gate.lag.lag() < 0.05, what="lag back to normal")
        gate.enter().exit()
    finally:
        await gate.close()


async def test_no_bounds_admit_everything_and_arrival_subtracts_a_stall() -> None:
    gate = OverloadGate(max_in_flight=0, max_loop_lag=0)
    tickets = [gate.enter() for _ in range(10_000)]
    assert gate.in_flight == 10_000
    for t in tickets:
        t.exit()
    lag = LoopLag(interval=0.005)
    lag.start()
    try:
        await poll(lambda: lag.samples >= 1, what="lag samples")
        got: list[float] = []

        def late_handler() -> None:
            time.sleep(0.1)
            got.append(time.monotonic() - arrival(lag))
        asyncio.get_running_loop().call_soon(late_handler)
        await poll(lambda: got, what="the late handler")
        assert got[0] >= 0.09
    finally:
        await lag.close()


def _hog(loop: asyncio.AbstractEventLoop, until: float, each: float) -> None:
    """A loop whose every iteration spends `each` seconds in this callback (a busy router)."""
    time.sleep(each)
    if time.monotonic() < until:
        loop.call_soon(_hog, loop, until, each)


async def test_accept_probe_sees_the_wait_before_handlers_that_loop_lag_misses() -> None:
    from router_svc.overload import AcceptProbe
    from services.grpc_util import GrpcServer

    server = GrpcServer("127.0.0.1", 0, [])
    await server.start()
    lag = LoopLag(interval=0.005)
    probe = AcceptProbe(server.address, interval=0.02)
    gate = OverloadGate(max_in_flight=0, max_loop_lag=0, lag=lag, max_accept_wait=0.015)
    gate.start()
    gate.probe_server(probe)
    try:
        await poll(lambda: probe.samples >= 3, what="probe samples")
        assert probe.last < 0.015, probe.last       # idle: a call is answered at once
        gate.enter().exit()
        loop = asyncio.get_running_loop()
        # Every iteration now takes 4 ms: the loop is never more than an iteration late, but a call
        # needs several iterations to be accepted and answered.
        loop.call_soon(_hog, loop, time.monotonic() + 1.5, 0.004)
        n = probe.samples
        await poll(lambda: probe.samples >= n + 3, what="probe samples under load")
        print(f"\naccept wait {probe.last * 1000:.1f} ms, loop lag {lag.lag() * 1000:.1f} ms")
        assert probe.last > 0.015, probe.last
        assert probe.last > lag.lag(), (probe.last, lag.lag())
        with pytest.raises(Unavailable) as e:
            gate.enter()
        assert e.value.reason == Reason.ROUTER_OVERLOADED and "accept" in e.value.message
        assert _sample("tokenrelay_router_accept_wait_seconds_count") >= probe.samples
    finally:
        await gate.close()
        await server.stop(0)


async def test_idle_spin_polls_while_requests_are_in_flight_and_for_its_window_after() -> None:
    """`--idle-spin-ms` (IdleSpin): the loop keeps polling (its spin callback runs over and over)
    from a request's arrival, through its whole life however long, until the window after the
    last one ended; then it sleeps again, and the seconds spun are counted. Timers keep their time."""
    from router_svc.overload import IdleSpin

    spin = IdleSpin(0.05)
    gate = OverloadGate(0, 0.0, spin=spin)
    assert not spin.spinning and spin.spins == 0
    before = _sample("tokenrelay_router_idle_spin_seconds_total")
    ticket = gate.enter()
    t0 = time.monotonic()
    await asyncio.sleep(0.15)              # three windows: still spinning, a request is in flight
    late = time.monotonic() - t0 - 0.15
    # Each turn yields the core (sched_yield): on a crowded host a turn may wait for other processes.
    assert spin.spinning and spin.spins > 20
    assert late < 0.1                      # a timer on a spinning loop fires on time
    ticket.exit()
    spun = spin.spins
    await asyncio.sleep(0.02)              # inside the window after the last request
    assert spin.spinning and spin.spins > spun
    await poll(lambda: not spin.spinning, what="the spin to stop after its window")
    stopped = spin.spins
    await asyncio.sleep(0.05)
    assert spin.spins == stopped           # asleep: no callback scheduled any more
    counted = _sample("tokenrelay_router_idle_spin_seconds_total") - before
    assert 0.2 <= counted < 2.0            # ~0.15 s in flight + the 0.05 s window
    with gate.enter():                     # a new request starts it again
        await asyncio.sleep(0.01)
        assert spin.spinning and spin.spins > stopped
        await gate.close()                 # and closing the gate stops it, a request in flight or not
    await poll(lambda: not spin.spinning, what="the spin to stop at close")


async def test_without_idle_spin_the_gate_schedules_nothing() -> None:
    gate = OverloadGate(0, 0.0)
    assert gate.spin is None
    loop = asyncio.get_running_loop()
    ready = getattr(loop, "_ready", None)   # the standard loop's queue of callbacks (uvloop has none to see)
    with gate.enter():
        assert ready is None or not ready


def test_idle_spin_ms_is_a_bounded_router_setting() -> None:
    from router_svc.config import RouterSettings
    from services.config import load_settings

    base = ["--tenants-file", "t.yaml"]
    assert load_settings(RouterSettings, base, environ={}).limits.idle_spin_ms == 0.0
    assert load_settings(RouterSettings, [*base, "--idle-spin-ms", "250"], environ={}).limits.idle_spin_ms == 250.0
    with pytest.raises(SystemExit):
        load_settings(RouterSettings, [*base, "--idle-spin-ms", "-1"], environ={})


@pytest.mark.parametrize("choice", ["asyncio", "uvloop"])
def test_a_loop_kept_polling_by_idle_spin_is_idle_to_the_relays_busy_meter(choice: str) -> None:
    """Found by the device runs of 2026-12-06 (sixth session): with --idle-spin-ms the loop thread
    used a whole core while it had nothing to do, the engine stream's waker (services/mux.py) took
    the loop for saturated and deferred tokens' wake-ups (the mesh's ITL p50 +0.2 ms, max 23 ms).
    Idle spinning is now reported (`services.loopidle.add_spun_idle`) and left out of the meter; on
    both loops (uvloop's `loop.time()` moves in whole milliseconds: the spin times its turns with
    `perf_counter`, a first fix that did not was still saturated there)."""
    from router_svc.overload import IdleSpin
    from services.eventloop import run, uvloop_available
    from services.mux import _Waker

    if choice == "uvloop" and not uvloop_available():
        pytest.skip("uvloop is not installed")

    async def body() -> None:
        loop = asyncio.get_running_loop()
        spin = IdleSpin(5.0)
        spin.touch()
        waker = _Waker(max_delay=0.02)
        try:
            t0 = loop.time()
            while loop.time() - t0 < 0.3:          # six of the waker's 50 ms windows, probed as a reader does
                waker.probe(loop)
                await asyncio.sleep(0.002)
            assert spin.spinning and spin.spins > 50
            assert not waker.saturated and not waker.behind
        finally:
            spin.stop()
        await poll(lambda: not spin.spinning, what="the spin to stop")

    run(body(), choice)  # type: ignore[arg-type]
