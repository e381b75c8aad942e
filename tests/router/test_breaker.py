"""The engine replicas' circuit breaker: the pure state machine against a fake clock, then one real
engine process that stops answering (SIGSTOP) and comes back (SIGCONT): its breaker opens after
N failed load polls and closes by itself once a probe succeeds."""

from __future__ import annotations

import asyncio
import os
import pathlib
import signal
import subprocess
import sys

import pytest

from router_svc import metrics
from router_svc.breaker import POLL, STREAM, Breaker, BreakerPolicy, BreakerState
from router_svc.types import Sampling
from router_svc.upstreams import EnginePool
from services.mux import StreamBroken
from tests.waiting import poll

REPO = pathlib.Path(__file__).resolve().parents[2]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _breaker(failures: int = 3, backoff: float = 1.0, cap: float = 5.0) -> tuple[Breaker, Clock, list[str]]:
    clock, moves = Clock(), []
    breaker = Breaker(BreakerPolicy(failures, backoff, cap), clock=clock,
                      on_transition=lambda _b, a, b: moves.append(f"{a.value}>{b.value}"))
    return breaker, clock, moves


def test_consecutive_failures_open_it_and_a_success_in_between_resets_the_count() -> None:
    b, _, moves = _breaker(failures=3)
    b.failure()
    assert b.state is BreakerState.CLOSED and b.suspect and not b.available()   # out until a success
    b.failure()
    b.success()                       # not consecutive any more; back in rotation
    assert b.available() and not b.suspect
    b.failure()
    b.failure()
    assert b.state is BreakerState.CLOSED and not b.available()
    b.success(POLL)                   # any success ends the suspicion, not the stream count
    assert b.available() and not b.clean(STREAM)
    b.failure()
    assert b.state is BreakerState.OPEN and not b.available() and not b.try_probe()
    assert moves == ["closed>open"] and b.backoff == 1.0


def test_kinds_are_counted_apart_so_answered_polls_do_not_hide_breaking_streams() -> None:
    b, _, _ = _breaker(failures=3)
    b.failure(STREAM)
    b.failure(POLL)
    b.failure(STREAM)
    b.success(POLL)                   # the engine answers its polls, its streams still break
    b.failure(POLL)
    b.failure(POLL)
    assert b.state is BreakerState.CLOSED and not b.clean(STREAM) and b.consecutive == 2
    b.failure(STREAM)
    assert b.state is BreakerState.OPEN


def test_half_open_lets_one_probe_through_and_its_outcome_decides() -> None:
    b, clock, moves = _breaker(failures=1, backoff=1.0, cap=5.0)
    b.failure()
    clock.now += 0.99
    assert b.state is BreakerState.OPEN
    b.success()                       # a late answer while open is no probe
    assert b.state is BreakerState.OPEN
    clock.now += 0.01
    assert b.state is BreakerState.HALF_OPEN and b.available()
    assert b.try_probe() and not b.available() and not b.try_probe()   # one probe at a time
    b.probe_done()                    # the probe request was cancelled: the slot is free again
    assert b.available() and b.try_probe()
    b.failure()                       # the probe failed: open again, twice as long
    assert b.state is BreakerState.OPEN and b.backoff == 2.0
    clock.now += 2.0
    b.failure()
    assert b.backoff == 4.0
    clock.now += 4.0
    b.failure()
    assert b.backoff == 5.0          # capped
    clock.now += 5.0
    assert b.state is BreakerState.HALF_OPEN
    b.success()
    assert b.state is BreakerState.CLOSED and b.available() and b.clean()
    b.failure()                       # closed again: the backoff starts over
    assert b.backoff == 1.0
    assert moves == ["closed>open", "open>half_open", "half_open>open", "open>half_open", "half_open>open",
                     "open>half_open", "half_open>open", "open>half_open", "half_open>closed", "closed>open"]


def test_policy_is_bounded() -> None:
    for bad in ((0, 1.0, 1.0), (1, 0.0, 1.0), (1, 2.0, 1.0)):
        with pytest.raises(ValueError):
            BreakerPolicy(*bad)


def _gauge(pool: str, state: str) -> float:
    value = metrics.ENGINE_REPLICAS.labels(pool, state)._value.get()
    return float(value)


async def test_a_replica_that_stops_answering_leaves_rotation_and_returns_by_itself(tmp_path: pathlib.Path) -> None:
    port_file = tmp_path / "engine.port"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "engine_svc", "--backend", "sim", "--port", "0", "--port-file", str(port_file),
        "--sim-vocab-size", "1000", "--sim-decode-step-time", "0.002", "--log-level", "WARNING",
        cwd=REPO, env=dict(os.environ), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pool: EnginePool | None = None
    try:
        port = await poll(lambda: port_file.exists() and port_file.read_text().strip(), timeout=30, what="port")
        address = f"127.0.0.1:{int(port)}"
        pool = EnginePool([address], poll_interval=0.1, poll_timeout=0.3, breaker=BreakerPolicy(2, 0.5, 1.0))
        await poll(_served(pool, address), timeout=20, what="the engine to serve")
        await pool.start()
        replica = pool.replicas[0]
        opened = metrics.BREAKER_TRANSITIONS.labels("open")._value.get()

        proc.send_signal(signal.SIGSTOP)     # alive but silent: every poll times out
        await poll(lambda: replica.breaker.state is BreakerState.OPEN, timeout=10, what="the breaker to open")
        assert replica.breaker.consecutive >= 2
        snap = pool.snapshots()[0]
        assert not snap.healthy and snap.serving        # out of rotation, and not mistaken for draining
        assert _gauge("default", "open") >= 1
        assert metrics.BREAKER_TRANSITIONS.labels("open")._value.get() > opened

        proc.send_signal(signal.SIGCONT)
        await poll(lambda: replica.breaker.state is BreakerState.CLOSED, timeout=10, what="the breaker to close")
        assert pool.snapshots()[0].healthy
        assert await _served(pool, address)()
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
        await asyncio.wait_for(proc.wait(), 10)
        if pool is not None:
            await pool.close()


def _served(pool: EnginePool, address: str):
    count = iter(range(1_000_000))

    async def served() -> bool:
        rid = f"probe-{next(count)}"
        inbox = pool.submit(address, rid, [1, 2, 3], Sampling(max_tokens=2, ignore_eos=True), [], "", {})
        try:
            while True:
                chunk = await asyncio.wait_for(inbox.get(), 5)
                if isinstance(chunk, StreamBroken) or chunk.error_reason:
                    return False
                if chunk.finished:
                    return True
        except asyncio.TimeoutError:
            return False
        finally:
            pool.release(address, rid)
    return served


async def test_the_replicas_gauge_follows_a_breaker_at_once_not_at_the_next_poll() -> None:
    # stream failures open a breaker between polls; the gauge (what dashboards and alerts read) must
    # say so then, not up to a poll interval later (a CI run read 0 open replicas right after one opened)
    pool = EnginePool([], poll_interval=60.0, breaker=BreakerPolicy(2, 0.5, 1.0))
    try:
        pool.add("gauge-pool", "127.0.0.1:9")
        replica = pool.replicas[0]
        assert _gauge("gauge-pool", "ready") == 1 and _gauge("gauge-pool", "open") == 0
        replica.breaker.failure(STREAM)
        assert _gauge("gauge-pool", "suspect") == 1 and _gauge("gauge-pool", "ready") == 0
        replica.breaker.failure(STREAM)
        assert replica.breaker.state is BreakerState.OPEN
        assert _gauge("gauge-pool", "open") == 1 and _gauge("gauge-pool", "suspect") == 0
    finally:
        await pool.close()
