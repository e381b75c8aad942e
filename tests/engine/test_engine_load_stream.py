"""Engine load reaches the router on the Stream it already has open: a real engine process, the
router's `EnginePool` as the client. Load is reported on the stream (first message, then at most
every interval when it changed), and a drain (SIGTERM) is flagged at once so the replica gets no
new work while its in-flight request still completes."""

from __future__ import annotations

import asyncio
import os
import pathlib
import signal
import subprocess
import sys

from engine_svc.engine import Engine
from engine_svc.session import StreamSession
from router_svc.types import Sampling
from router_svc.upstreams import EnginePool
from services.errors import Reason, TokenrelayError
from services.mux import StreamBroken
from tests.engine.engine_testkit import fast_sim
from tests.waiting import poll

REPO = pathlib.Path(__file__).resolve().parents[2]


async def _engine(tmp: pathlib.Path) -> tuple[asyncio.subprocess.Process, str]:
    port_file = tmp / "engine.port"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "engine_svc", "--backend", "sim", "--port", "0", "--port-file", str(port_file),
        "--sim-vocab-size", "1000", "--sim-decode-step-time", "0.002", "--shutdown-grace", "30",
        "--log-level", "WARNING", cwd=REPO, env=dict(os.environ), stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)
    port = await poll(lambda: port_file.exists() and port_file.read_text().strip(), timeout=30, what="port")
    return proc, f"127.0.0.1:{int(port)}"


async def test_load_rides_on_the_stream_and_a_drain_is_flagged(tmp_path: pathlib.Path) -> None:
    proc, address = await _engine(tmp_path)
    # A poll interval far beyond the test: whatever load the pool learns after start() came on the stream.
    pool = EnginePool([address], poll_interval=3600)
    try:
        await poll(_polled(pool), timeout=20, what="first poll")
        replica = pool.replicas[0]
        assert replica.load_reports == 0 and replica.snapshot().active == 0
        inbox = pool.submit(address, "long", list(range(8)), Sampling(max_tokens=2000, ignore_eos=True), [], "", {})
        first = await asyncio.wait_for(inbox.get(), 10)
        assert not isinstance(first, StreamBroken)
        await poll(lambda: replica.load_reports >= 1 and replica.snapshot().active == 1, timeout=10,
                   what="load report on the stream")
        snap = pool.snapshots()[0]
        assert snap.address == address and snap.healthy and snap.serving and snap.in_flight == 1
        assert snap.max_active > 0 and snap.kv_total > 0
        # Reports are bounded: at most one per interval (50 ms), not one per message.
        reports, messages = replica.load_reports, replica.mux.messages_received
        await poll(lambda: replica.mux.messages_received >= messages + 40, timeout=10, what="more messages")
        assert replica.load_reports - reports < (replica.mux.messages_received - messages) / 2
        assert replica.serving

        proc.send_signal(signal.SIGTERM)
        await poll(lambda: not replica.serving, timeout=10, what="drain flagged on the stream")
        assert not pool.snapshots()[0].serving
        try:
            pool.pick()
        except TokenrelayError as exc:
            assert exc.reason == Reason.NO_HEALTHY_REPLICA
        else:
            raise AssertionError("a draining replica was picked")
        # The in-flight request is not cut: it still gets tokens after the drain started.
        got = await asyncio.wait_for(inbox.get_ready(), 10)
        assert got and not any(isinstance(c, StreamBroken) for c in got)
        pool.abort(address, "long")
        pool.release(address, "long")
        await asyncio.wait_for(proc.wait(), 30)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await pool.close()


def _polled(pool: EnginePool):
    async def polled() -> bool:
        await pool.poll_once()
        return pool.replicas[0].healthy
    return polled


async def test_take_load_is_due_on_change_at_most_every_interval_and_at_once_on_drain() -> None:
    from engine_svc.backends.sim import SimBackend

    engine = Engine(SimBackend(fast_sim()), max_queued=4)
    await engine.start()
    try:
        session = StreamSession(engine, load_interval=3600)
        first = session.take_load()
        assert first is not None and first[1] is False          # the first message carries one
        assert session.take_load() is None                      # not again within the interval
        engine.drain()
        drained = session.take_load()
        assert drained is not None and drained[1] is True       # a drain is due at once
        assert session.take_load() is None
        fast = StreamSession(engine, load_interval=0)
        assert fast.take_load() is not None
        assert fast.take_load() is None                         # unchanged: nothing to report
    finally:
        await engine.close()

