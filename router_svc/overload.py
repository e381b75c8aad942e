"""Overload protection of one router process: measure its event-loop lag and in-flight work, refuse early.

A router whose loop is saturated does not fail: every stream gets slower and TTFT grows to seconds,
while new calls queue inside gRPC before any handler runs (time the process cannot see). So the
process refuses what it cannot serve in time, at the very start of each Generate call and Chat
turn, in O(1): `UNAVAILABLE` / `ROUTER_OVERLOADED` with a retry-after when

- the requests it already serves reach `--max-requests-in-flight`, or
- its event loop lags more than `--max-loop-lag-ms` (a loop that late adds that much to every
  stream's next token and to the start of every call waiting behind it).

`LoopLag` is the monitor: one task that sleeps `interval` and records how late it woke (the time
every other callback waited too). `lag()` is the larger of the last sample and how overdue the
monitor is right now, so a stall in progress counts before the monitor gets to run again.
`OverloadGate` implements the `LoadGate` port: ``ticket = gate.enter()`` (raises when refused) and
``ticket.exit()`` (idempotent) when the request or turn ends.

What neither can see: time a call spends before its handler runs or before its first message
reaches the client. grpc.aio accepts one call per few loop iterations (one `request_call` kept
outstanding), so long iterations slow accepts (a bare server with 5 ms iterations: ~5 iterations
per accepted call). `AcceptProbe` measures that path from outside: a health Check to this very
server every `interval`; with ``max_accept_wait`` the gate refuses while it is above the bound
(`--max-accept-wait-ms`, default 0 = measure only). Measured on the lent H200 host (mesh on 4
cores, sim, 256 streams): the probe saw 8-9 ms while clients got `accepted` 680 ms later than the
router's own clock says, on 1 or 16 connections; so that wait is not the unary accept path, and
the probe is a metric, not yet a bound (docs/architecture.md, "Overload").
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections.abc import Callable
from types import TracebackType

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.channels import open_channel
from services.errors import Reason
from services.loopidle import add_spun_idle
from services.security import PLAINTEXT, SecuritySettings
from services.tasks import OwnedTask

from . import metrics

# A loop turn between two spin callbacks shorter than this ran nothing else worth counting: idle.
_IDLE_TURN = 50e-6
# A refusal's retry-after: at least this, plus the lag that caused it (bounded).
_MIN_RETRY_AFTER = 0.05
_MAX_RETRY_AFTER = 2.0


class LoopLag:
    """Event-loop lag of this process, sampled by one task (owner: start()/close())."""

    def __init__(self, interval: float = 0.01, window: float = 1.0) -> None:
        self.interval = interval
        self._buckets = max(2, round(window / 0.1))     # the recent max: per-100-ms maxima
        self._maxima: list[float] = [0.0] * self._buckets
        self._bucket_started = 0.0
        self._bucket = 0
        self.last = 0.0            # the last completed sample, seconds
        self.samples = 0
        self._due: float | None = None
        self._task = OwnedTask("loop-lag")

    def start(self) -> None:
        self._task.ensure(self._run)

    async def close(self) -> None:
        await self._task.close()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        self._bucket_started = loop.time()
        while True:
            self._due = loop.time() + self.interval
            await asyncio.sleep(self.interval)
            now = loop.time()
            self.record(max(0.0, now - self._due), now)

    def record(self, lag: float, now: float) -> None:
        self.last = lag
        self.samples += 1
        metrics.LOOP_LAG.observe(lag)
        if now - self._bucket_started >= 0.1:
            self._bucket = (self._bucket + 1) % self._buckets
            self._maxima[self._bucket] = 0.0
            self._bucket_started = now
            metrics.LOOP_LAG_MAX.set(max(self._maxima))
        if lag > self._maxima[self._bucket]:
            self._maxima[self._bucket] = lag

    def overdue(self) -> float:
        """How late the monitor is right now: a stall in progress (0 when the loop is on time)."""
        if self._due is None:
            return 0.0
        return max(0.0, asyncio.get_running_loop().time() - self._due)

    def lag(self) -> float:
        """The loop's lag now: the last sample, or the stall in progress if longer."""
        return max(self.last, self.overdue())

    def recent_max(self) -> float:
        """The largest sample of the last `window` seconds."""
        return max(max(self._maxima), self.overdue())


class AcceptProbe:
    """How long a new unary call to this server waits for its answer: a health Check to its own
    address every `interval` (owner: start()/close()). Behind SO_REUSEPORT the probe's connection
    may land on a sibling process; each process should then probe a port of its own."""

    def __init__(self, address: str, security: SecuritySettings = PLAINTEXT, *, interval: float = 0.25,
                 timeout: float = 5.0) -> None:
        self.address, self.security = address, security
        self.interval, self.timeout = interval, timeout
        self.last = 0.0        # seconds, the last probe's round trip (timeout when it failed)
        self.samples = 0
        self._task = OwnedTask("accept-probe")

    def start(self) -> None:
        self._task.ensure(self._run)

    async def close(self) -> None:
        await self._task.close()

    async def _run(self) -> None:
        channel = open_channel(self.address, self.security.self_client())   # trusts its own certificate
        stub = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest(service="")
        try:
            while True:
                t0 = time.perf_counter()
                try:
                    await stub.Check(request, timeout=self.timeout)
                    wait = time.perf_counter() - t0
                except grpc.RpcError:
                    wait = max(time.perf_counter() - t0, self.timeout)
                self.last = wait
                self.samples += 1
                metrics.ACCEPT_WAIT.observe(wait)
                await asyncio.sleep(self.interval)
        finally:
            await channel.close()


class IdleSpin:
    """Keep the event loop polling instead of sleeping while requests are in flight here and for
    `window` seconds after the last one ended (`--idle-spin-ms`; owner: the gate's `enter`/`exit`).

    Why: on the machines measured (virtual machines, 2026-12-06), code that runs after the process
    slept in the kernel, even for half a millisecond, runs several times slower than back to back
    (a 130-character encode: 77 us back to back, 220-270 us after a 50 ms sleep, 83-106 us after
    50 ms of spinning; docs/benchmarks.md). At light load the router sleeps between every step of a
    request (a Redis reply, an engine step), so its first token pays that on each. Spinning costs
    one core while it lasts (a loop callback that schedules itself: the loop polls its sockets with
    no timeout instead of blocking); under load the loop is busy anyway and the spin costs nothing.
    Give it only to routers with a core of their own: under a CPU quota (a container limit) the
    spin is throttled, which is worse than sleeping."""

    def __init__(self, window: float) -> None:
        self.window = window
        self.busy: Callable[[], bool] = lambda: False   # work in flight (the gate's count)
        self.spinning = False
        self.spins = 0              # loop iterations spun (tests)
        self._until = 0.0
        self._started = 0.0
        self._last = 0.0            # perf_counter() at the last spin callback
        self._loop: asyncio.AbstractEventLoop | None = None

    def touch(self) -> None:
        """Work arrived or ended: spin until `window` after now, and while work is in flight."""
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        now = loop.time()
        self._until = now + self.window
        if not self.spinning:
            self.spinning = True
            self._started = now
            self._last = time.perf_counter()
            loop.call_soon(self._spin)

    def stop(self) -> None:
        """Stop at the next turn whatever is in flight (the gate is closing)."""
        self._until = 0.0
        self.busy = lambda: False

    def _spin(self) -> None:
        loop = self._loop
        assert loop is not None
        self.spins += 1
        tick = time.perf_counter()      # not loop.time(): uvloop's advances in whole milliseconds
        if tick - self._last < _IDLE_TURN:
            # A turn that ran little but this callback: idle time, which the busy-share meters
            # (services/mux.py's waker) leave out; a spinning loop is not a saturated one.
            add_spun_idle(tick - self._last)
        self._last = tick
        now = loop.time()
        if now < self._until or self.busy():
            # The GIL and the core are let go for a moment: the process's other threads (gRPC's
            # completion poller, the encoder's worker) run now, not after a switch interval.
            os.sched_yield()
            loop.call_soon(self._spin)
            return
        self.spinning = False
        metrics.IDLE_SPIN_SECONDS.inc(now - self._started)


class Ticket:
    """One admitted request or chat turn of this process; `exit()` once it ends (idempotent)."""

    __slots__ = ("_gate", "arrived")

    def __init__(self, gate: OverloadGate, arrived: float) -> None:
        self._gate: OverloadGate | None = gate
        self.arrived = arrived

    def exit(self) -> None:
        gate, self._gate = self._gate, None
        if gate is not None:
            gate._exit()

    def __enter__(self) -> Ticket:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.exit()


class OverloadGate:
    """The `LoadGate` of one router process: refuse in O(1) what it cannot serve in time.

    ``max_in_flight`` 0 and ``max_loop_lag`` 0 disable the respective bound.
    """

    def __init__(self, max_in_flight: int, max_loop_lag: float, lag: LoopLag | None = None, *,
                 max_accept_wait: float = 0.0, probe: AcceptProbe | None = None,
                 spin: IdleSpin | None = None) -> None:
        self.max_in_flight = max_in_flight
        self.max_loop_lag = max_loop_lag
        self.lag = lag if lag is not None else LoopLag()
        self.max_accept_wait = max_accept_wait
        self.probe = probe
        self.in_flight = 0
        self.refused = 0
        self.spin = spin
        if spin is not None:
            spin.busy = lambda: self.in_flight > 0

    def start(self) -> None:
        self.lag.start()

    def probe_server(self, probe: AcceptProbe) -> None:
        """Start measuring the accept wait of the server (once it listens)."""
        self.probe = probe
        probe.start()

    async def close(self) -> None:
        if self.spin is not None:
            self.spin.stop()
        await self.lag.close()
        if self.probe is not None:
            await self.probe.close()

    def enter(self, arrived: float | None = None) -> Ticket:
        """Admit one request (or chat turn) into this process, or raise ROUTER_OVERLOADED.

        ``arrived`` is when the handler started (`time.monotonic()`), kept on the ticket."""
        if self.max_in_flight and self.in_flight >= self.max_in_flight:
            self._refuse("in_flight", f"this router serves {self.in_flight} requests (its limit, "
                                      f"--max-requests-in-flight)", 0.0)
        if self.max_loop_lag:
            lag = self.lag.lag()
            if lag > self.max_loop_lag:
                self._refuse("loop_lag", f"this router's event loop lags {lag * 1000:.0f} ms (limit "
                                         f"{self.max_loop_lag * 1000:.0f} ms, --max-loop-lag-ms)", lag)
        if self.max_accept_wait and self.probe is not None and self.probe.last > self.max_accept_wait:
            wait = self.probe.last
            self._refuse("accept_wait", f"new calls wait {wait * 1000:.0f} ms for this router to accept them "
                                        f"(limit {self.max_accept_wait * 1000:.0f} ms, --max-accept-wait-ms)", wait)
        self.in_flight += 1
        metrics.PROCESS_IN_FLIGHT.set(self.in_flight)
        if self.spin is not None:
            self.spin.touch()
        return Ticket(self, time.monotonic() if arrived is None else arrived)

    def _refuse(self, cause: str, message: str, lag: float) -> None:
        self.refused += 1
        metrics.REFUSED.labels(cause).inc()
        # Jittered up to +50%: clients refused in one burst do not all come back in the same instant
        # (a synchronized retry wave is refused again as a burst, and each waits behind the others).
        retry_after = min(_MAX_RETRY_AFTER, (_MIN_RETRY_AFTER + 2 * lag) * (1.0 + 0.5 * random.random()))
        raise Reason.ROUTER_OVERLOADED.error(message, retry_after=retry_after)

    def _exit(self) -> None:
        self.in_flight -= 1
        metrics.PROCESS_IN_FLIGHT.set(self.in_flight)
        if self.spin is not None:
            self.spin.touch()


def arrival(lag: LoopLag | None = None) -> float:
    """When the call arrived, as far as the process can tell: `time.monotonic()` at the handler's
    first line, minus the loop stall in progress when ``lag`` is given (a handler that starts while
    the loop is that late was held up at least that long). The time a call spends in gRPC's own
    queue before its handler task exists is not visible from here (docs/architecture.md)."""
    now = time.monotonic()
    return now - lag.overdue() if lag is not None else now
