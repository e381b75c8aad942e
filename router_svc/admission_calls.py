"""The admission store's calls, timed and batched (router_svc/admission.py uses them).

`Timed`: one script call's verdict within op_timeout of *Redis's* time, by one timer and callbacks;
a timer that fires late (the loop stalled or saturated: the reply may be waiting unread in the
socket) extends the call instead of failing it. `Batcher`: the calls of one script submitted in
one loop iteration go out as one call, at most a few in flight.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from redis.exceptions import ConnectionError as RedisConnectionError

from . import metrics

if TYPE_CHECKING:
    from .admission import Admission

__all__ = ["LATE", "MAX_EXTENSIONS", "Batcher", "Timed"]

# The loop is "late" when a timer fires more than this after it was due: then an operation's
# time ran on the loop, not in Redis, and it gets more time (at most MAX_EXTENSIONS times).
LATE = 0.02
MAX_EXTENSIONS = 8
_BUSY = 0.9         # the loop thread's CPU share at which the process counts as behind
_WINDOW = 0.1       # seconds over which that share is measured


class Timed:
    """One admission-store call timed by callbacks: one timer per call, no task and no `asyncio.wait`
    (those cost more than the call's own Python under load); `Admission._watch` awaits the same
    rule. `done(exc)` runs once: with None when `op` answered (its outcome may still be a Redis
    error), or a TimeoutError when Redis took longer than op_timeout of *its* time. `op` is never
    cancelled (a command cut off mid-reply would poison its connection). `batcher` (None for a lone
    call) says whether the loop is behind and how late its flushes run."""

    __slots__ = ("_adm", "_batcher", "_done", "_due", "_extensions", "_hops", "_op", "_over", "_probe", "_t0",
                 "_timer", "_what")

    def __init__(self, adm: Admission, batcher: Batcher | None, op: asyncio.Future[Any], what: str,
                 done: Callable[[BaseException | None], None]) -> None:
        loop = asyncio.get_running_loop()
        self._adm, self._batcher, self._op, self._what, self._done = adm, batcher, op, what, done
        self._t0 = loop.time()
        self._due = self._t0 + adm.settings.op_timeout
        self._extensions = 0
        self._over = False
        self._hops, self._probe = 0, 0.0
        self._timer = loop.call_at(self._due, self._check)
        op.add_done_callback(self._answered)

    def _answered(self, op: asyncio.Future[Any]) -> None:
        if self._over:          # given up already: its late outcome goes to the batch's `_ran_late`
            return
        self._over = True
        self._timer.cancel()
        self._adm.redis_seconds(self._what).observe(asyncio.get_running_loop().time() - self._t0)
        self._done(None)

    def _check(self) -> None:
        if self._op.done() or self._over:    # its done-callback is on its way
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        late = now - self._due
        if self._extensions >= MAX_EXTENSIONS:
            self._time_out(now)
            return
        # A loop that is behind (busy all the time) may hold the reply unread: as late as a stall.
        if late > LATE or (self._batcher is not None and self._batcher.loop_behind(now)):
            self._extend(now, late)
            return
        # On time, by the timer and the CPU share. A reply already read still needs two loop
        # iterations to complete the call (redis-py's task resumes, then its future's callbacks), and
        # on a loop whose iterations are long (or a thread short of CPU on a shared host) those show
        # what the timer cannot: so the verdict waits two iterations and times them.
        self._hops, self._probe = 0, now
        loop.call_soon(self._confirm)

    def _confirm(self) -> None:
        if self._op.done() or self._over:
            return
        loop = asyncio.get_running_loop()
        self._hops += 1
        if self._hops < 2:
            loop.call_soon(self._confirm)
            return
        now = loop.time()
        if now - self._probe > LATE:   # two iterations took longer than a late timer: the loop is behind
            self._extend(now, now - self._probe)
        else:
            self._time_out(now)

    def _time_out(self, now: float) -> None:
        self._over = True
        metrics.REDIS_FAILURES.labels(self._what, "timeout").inc()
        self._adm.redis_seconds(self._what).observe(now - self._t0)
        self._done(asyncio.TimeoutError(f"no reply in {now - self._t0:.3f}s"))

    def _extend(self, now: float, late: float) -> None:
        """The loop was stalled or saturated, and the reply may be waiting in the socket: give it the
        loop's lateness again (at least 0.1 s)."""
        self._extensions += 1
        flush_lag = self._batcher.lag if self._batcher is not None else 0.0
        self._due = now + min(self._adm.settings.op_timeout, max(0.1, 2 * late, flush_lag))
        self._timer = asyncio.get_running_loop().call_at(self._due, self._check)


_Entry = tuple[list[Any], "asyncio.Future[list[Any]]", "Callable[[list[Any]], None] | None", float]


class Batcher:
    """Calls of one script submitted in the same event-loop iteration go out as ONE call: one round
    trip, one script start, one pack of the arguments — under load a call carries many requests.

    At most `max_calls` calls of the script are in flight: what is submitted meanwhile waits and goes
    out in one call when one answers, so the busier the process, the larger (and cheaper per request)
    its calls, instead of more calls than its connections and its CPU can serve. When a call times
    out (Redis stalled), what waits for its turn fails with it: so every entry is still decided
    within op_timeout of being added, as when each had its own call. `behind()` is how long the
    oldest entry not yet sent has waited *while this process is behind* (its loop busy all the
    time, or late): `Admission.admit` refuses new requests early (ROUTER_OVERLOADED) while it is
    beyond a bound, rather than letting them and the settles behind them time out. A stalled Redis
    with an idle loop is not "behind": that wait ends in the configured failure (fail open or
    closed) as before.

    `add(args)` returns a future of this entry's slice of the reply (`width` values); the grants
    that follow the entries go to the book. A caller that stops waiting leaves its entry in the
    call; `late(slice)`, when given, receives the slice of an entry whose caller stopped waiting or
    whose call timed out and then ran after all."""

    def __init__(self, admission: Admission, script: str, width: int, max_batch: int = 128,
                 max_calls: int = 2) -> None:
        self._admission, self._script, self._width, self._max = admission, script, width, max_batch
        self._what = script.lower()
        self._max_calls = max(1, max_calls)
        self._pending: list[_Entry] = []
        self._scheduled = False
        self._scheduled_at = 0.0
        self.in_flight = 0
        # How busy and how late this process's loop is, measured by the flushes: the loop thread's
        # CPU share over the last window, and how late the last flush ran after it was scheduled.
        self._window = (0.0, 0.0)
        self.busy = 0.0
        self.lag = 0.0
        self._flushed_at = 0.0

    def add(self, args: list[Any], late: Callable[[list[Any]], None] | None = None) -> asyncio.Future[list[Any]]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[list[Any]] = loop.create_future()
        now = loop.time()
        self._pending.append((args, fut, late, now))
        if not self._scheduled and self.in_flight < self._max_calls:
            if not self.in_flight and len(self._pending) == 1:
                # Idle (no call in flight, nothing else waiting): nothing to batch it with, so it is
                # written now rather than a loop turn later, on a request's path to its first token.
                self._drain()
                return fut
            self._scheduled = True
            self._scheduled_at = now
            loop.call_soon(self._flush)
        return fut

    def behind(self) -> float:
        """Seconds the oldest entry not yet sent has waited, when this process is behind (else 0.0)."""
        if not self._pending:
            return 0.0
        now = asyncio.get_running_loop().time()
        return now - self._pending[0][3] if self.loop_behind(now) else 0.0

    def loop_behind(self, now: float) -> bool:
        """This process's loop is busy all the time or late (rather than waiting for Redis)."""
        self._measure(now)
        return self.busy >= _BUSY or (self.lag if now - self._flushed_at < 2 * _WINDOW else 0.0) >= LATE or (
            self._scheduled and now - self._scheduled_at >= LATE)

    def _measure(self, now: float) -> None:
        t0, cpu0 = self._window
        if now - t0 >= _WINDOW:
            cpu = time.thread_time()
            self.busy = (cpu - cpu0) / (now - t0) if t0 else 0.0
            self._window = (now, cpu)

    def _flush(self) -> None:
        loop = asyncio.get_running_loop()
        self._scheduled = False
        now = self._flushed_at = loop.time()
        self.lag = now - self._scheduled_at
        self._measure(now)
        self._drain()

    def _drain(self) -> None:
        while self._pending and self.in_flight < self._max_calls:
            batch = self._pending[:self._max]
            del self._pending[:self._max]
            self._send(batch)

    def _send(self, batch: list[_Entry]) -> None:
        flat: list[Any] = [len(batch)]
        for entry in batch:
            flat.extend(entry[0])
        self.in_flight += 1
        op = self._admission.call(self._script, *flat)
        self._admission._track(op)      # close() waits for it
        Timed(self._admission, self, op, self._what, lambda exc: self._answered(op, batch, exc))

    def _answered(self, op: asyncio.Future[Any], batch: list[_Entry], exc: BaseException | None) -> None:
        self.in_flight -= 1
        try:
            if exc is None:
                if op.cancelled():      # only at close
                    exc = RedisConnectionError("admission store call cancelled")
                else:
                    exc = op.exception()
            if exc is None:
                self._deliver(op.result(), batch, late_only=False)
                return
            failed = batch
            if not op.done():   # timed out: it may still run; what waits behind it fails with it
                op.add_done_callback(functools.partial(self._ran_late, batch=batch))
                failed = batch + self._pending
                self._pending = []
            for entry in failed:
                fut = entry[1]
                if not fut.done():
                    fut.set_exception(exc)
        finally:
            if self._pending and not self._scheduled:
                loop = asyncio.get_running_loop()
                self._scheduled = True
                self._scheduled_at = loop.time()
                loop.call_soon(self._flush)

    def _ran_late(self, op: asyncio.Future[Any], batch: list[_Entry]) -> None:
        if not op.cancelled() and op.exception() is None:
            self._deliver(op.result(), batch, late_only=True)

    def _deliver(self, reply: list[Any], batch: list[_Entry], late_only: bool) -> None:
        w = self._width
        for i, (_, fut, late, _) in enumerate(batch):
            part = reply[i * w:(i + 1) * w]
            if not late_only and not fut.done():
                fut.set_result(part)
            elif late is not None:
                late(part)
        self._admission.book.notices(reply[len(batch) * w:])
