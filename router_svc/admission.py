"""Redis-backed admission: one priority / fair / token-budget queue shared by every router replica.

A request is *enqueued* (one script call: limits checked, queued, and dispatched at once when
the engine pool has room and it is first in line), then holds a *lease* with a fencing token
until it is *settled* (one script call: actual tokens charged, the lease freed, the next
requests dispatched). Any replica's call may grant any queued request; its owner — the router
holding the client's stream — learns it from the reply (its own) or from a message on its
channel, and from its next heartbeat if that message was lost. So the hot path is two round
trips; everything else is batched per process (`Book`: one heartbeat call for all leases and
queued requests, one reaper call per --reap-interval). The queue's semantics live in
`queue_lua.py`.

Operations are timed so that a stalled event loop never counts as Redis's time (`_watch`),
retried once on a fresh connection (every script is idempotent: a retried enqueue carries the
same nonce), and a Redis failure is the configured choice: fail closed (REDIS_UNAVAILABLE) or
fail open on this process's own limits (`LocalLimits`), logged and counted. When Redis comes
back empty (restart without persistence), the next heartbeat restores every lease and queued
request this process holds; scripts reload themselves after NOSCRIPT (restart, SCRIPT FLUSH).

The hot path's client cost is per *call*, not per request, where it can be (`Batcher`): the
enqueues (and the settles) of one loop iteration share one call, at most a few calls of each
script are in flight (what arrives meanwhile goes in the next, larger one), and a call is timed
by one timer and callbacks (`_Timed`), with no task or `asyncio.wait` of its own. A process that
falls behind (its loop busy all the time or late while calls wait for their turn beyond
min(0.25 s, op_timeout / 4)) refuses new requests at once with ROUTER_OVERLOADED and a
retry-after instead of queueing them behind calls that would time out (issue 11: before this,
5k requests/s on two single-core routers collapsed to 929/s with p50 10.9 s).
"""

from __future__ import annotations

import asyncio
import functools
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError, RedisError

from services.errors import Reason, TokenrelayError
from services.logging import get_logger

from . import metrics, queue_lua
from .admission_book import Book, Lease, LocalLease, LocalLimits, Waiter
from .admission_settings import AdmissionSettings
from .cluster_redis import open_redis
from .ports import AdmitRequest

__all__ = ["Admission", "AdmissionSettings", "Admitting", "Lease"]

log = get_logger(__name__)
T = TypeVar("T")

# The loop is "late" when a timer fires more than this after it was due: then an operation's
# time ran on the loop, not in Redis, and it gets more time (at most _MAX_EXTENSIONS times).
_LATE = 0.02
_MAX_EXTENSIONS = 8
# Longest wait of a hot-path call for its turn before new requests are refused (at most
# op_timeout / 4): see `Admission.max_backlog`.
_MAX_BACKLOG = 0.25
_BUSY = 0.9         # the loop thread's CPU share at which the process counts as behind
_WINDOW = 0.1       # seconds over which that share is measured
_MAX_CHILDREN = 4096
_OVERLOADED = Reason.ROUTER_OVERLOADED.value.lower()
_REFUSAL_TEXT = {
    Reason.TENANT_CONCURRENCY_LIMIT: "tenant {t!r} has {mi} requests in flight (its limit) and may not queue more",
    Reason.TENANT_QUEUE_FULL: "tenant {t!r} has {mq} requests queued (its max_queued) and the engines are busy",
    Reason.CLASS_QUEUE_FULL: "the {c} queue is full",
    Reason.TOKEN_RATE_LIMITED: "tenant {t!r} is over its {tpm} tokens per minute",
    Reason.TOKEN_BUDGET_TOO_SMALL: "the request's estimate ({cost} tokens: prompt + max_tokens) exceeds tenant "
                                   "{t!r}'s whole budget of {tpm} tokens per minute; lower max_tokens",
    Reason.QUEUE_WAIT_EXCEEDS_DEADLINE: "the estimated queue wait exceeds the request's deadline",
}


def _retrieve(op: asyncio.Future[Any]) -> None:
    """Mark an abandoned operation's outcome as seen (its failure was already reported)."""
    if not op.cancelled():
        op.exception()


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class _Timed:
    """`Admission._watch` for a batched call, by callbacks: one timer per call, no task and no
    `asyncio.wait` (those cost more than the call's own Python under load). `done(exc)` runs once:
    with None when `op` answered (its outcome may still be a Redis error), or a TimeoutError when
    Redis took longer than op_timeout of *its* time; `op` is never cancelled (see `_watch`)."""

    __slots__ = ("_adm", "_batcher", "_done", "_due", "_extensions", "_hops", "_op", "_over", "_probe", "_t0",
                 "_timer", "_what")

    def __init__(self, adm: Admission, batcher: Batcher, op: asyncio.Future[Any], what: str,
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
        if self._extensions >= _MAX_EXTENSIONS:
            self._time_out(now)
            return
        # A loop that is behind (busy all the time) may hold the reply unread: as late as a stall.
        if late > _LATE or self._batcher.loop_behind(now):
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
        if now - self._probe > _LATE:   # two iterations took longer than a late timer: the loop is behind
            self._extend(now, now - self._probe)
        else:
            self._time_out(now)

    def _time_out(self, now: float) -> None:
        self._over = True
        metrics.REDIS_FAILURES.labels(self._what, "timeout").inc()
        self._adm.redis_seconds(self._what).observe(now - self._t0)
        self._done(asyncio.TimeoutError(f"no reply in {now - self._t0:.3f}s"))

    def _extend(self, now: float, late: float) -> None:
        """The loop was stalled or saturated, and the reply may be waiting in the socket (see `_watch`)."""
        self._extensions += 1
        self._due = now + min(self._adm.settings.op_timeout, max(0.1, 2 * late, self._batcher.lag))
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
        return self.busy >= _BUSY or (self.lag if now - self._flushed_at < 2 * _WINDOW else 0.0) >= _LATE or (
            self._scheduled and now - self._scheduled_at >= _LATE)

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
        _Timed(self._admission, self, op, self._what, lambda exc: self._answered(op, batch, exc))

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


class Admitting:
    """One request in admission: granted at once (`grant` set) or queued (`position`, `next()`)."""

    def __init__(self, admission: Admission, waiter: Waiter | None, grant: Lease | LocalLease | None,
                 position: int) -> None:
        self._admission = admission
        self._waiter = waiter
        self._grant = grant
        self.position = position

    @property
    def grant(self) -> Lease | LocalLease | None:
        if self._grant is None and self._waiter is not None:
            return self._waiter.lease
        return self._grant

    async def next(self) -> None:
        """Wait until the position changes or the request is granted; raises its typed failure."""
        waiter = self._waiter
        assert waiter is not None
        if waiter.lease is None and waiter.error is None:
            await waiter.changed()
        if waiter.error is not None:
            raise waiter.error
        self.position = waiter.position

    def cancel(self) -> None:
        """Cancelled (by the client, any router's Cancel): out of the queue at once."""
        if self._waiter is not None and self.grant is None:
            self._waiter.fail(Reason.CANCELLED.error("cancelled while queued"))

    async def abandon(self) -> None:
        """The request will not run (cancelled, deadline, client gone): its queue entry goes, or
        its grant — if one raced in — is settled at zero tokens. Runs to the end when cancelled."""
        grant = self.grant
        if grant is not None:
            await grant.settle_tokens(0)
        elif self._waiter is not None:
            await asyncio.shield(self._admission._spawn(self._admission._withdraw(self._waiter)))


class Admission:
    """The admission queue as one router process sees it (one per process)."""

    def __init__(self, settings: AdmissionSettings, router_id: str = "") -> None:
        self.settings = settings
        self.router_id = router_id or uuid.uuid4().hex[:16]
        # redis-py's own timeouts are loop timers too, so they are only a backstop far beyond
        # op_timeout; `_watch` times operations. Retried once on a fresh connection.
        backstop = settings.op_timeout * (_MAX_EXTENSIONS + 2)
        self.redis = open_redis(settings.redis_url, backstop, connect_timeout=settings.op_timeout,
                                max_connections=settings.max_connections, retry_on=[RedisConnectionError],
                                **settings.redis_options())
        self._scripts = {name: self.redis.register_script(getattr(queue_lua, name))
                         for name in ("ENQUEUE", "SETTLE", "CANCEL", "BEAT", "REAP")}
        self.classes = settings.class_table()
        self._classes_arg = ";".join(f"{c.name},{c.min_share},{c.max_queued}" for c in self.classes)
        self._class_of: dict[int, str] = {}
        self._meta = f"tq:{{{settings.pool}}}:meta"
        self.channel = f"tq:{{{settings.pool}}}:g:{self.router_id}"
        # The pool's capacity in requests as this process sees its engines (`app.py` sets it);
        # None = unknown, then settings.pool_capacity (or the capacity Redis last stored).
        self.capacity: Callable[[], int | None] = lambda: None
        self.book = Book(self)
        # Calls in flight per script: the connections but the grant listener's and two for the
        # heartbeat, reaper and cancels (the two scripts share them; a call beyond the pool's
        # connections waits for one, inside its op_timeout). Half as many each cost the queue's
        # grant latency under a closed loop (test_admission_fairness) for no CPU measurably saved.
        calls = max(1, settings.max_connections - 3)
        self.enqueues = Batcher(self, "ENQUEUE", 3, max_calls=calls)
        self.settles = Batcher(self, "SETTLE", 1, max_calls=calls)
        # New requests are refused (ROUTER_OVERLOADED) while a hot-path call waits this long to be
        # sent: the process (its loop, its connections) is behind, and more requests would only
        # make every admission and settle behind them later until they time out.
        self.max_backlog = min(_MAX_BACKLOG, settings.op_timeout / 4)
        self.local = LocalLimits()
        self._background: set[asyncio.Future[Any]] = set()
        # Labelled metric children, looked up once per label set rather than once per request.
        self._outcomes: dict[tuple[str, str, str], Any] = {}
        self._queue_times: dict[tuple[str, str], Any] = {}
        self._seconds: dict[str, Any] = {}

    # --------------------------------------------------------------------------------- plumbing
    def _spawn(self, coro: Awaitable[T]) -> asyncio.Task[T]:
        task: asyncio.Task[T] = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def _track(self, op: asyncio.Future[Any]) -> None:
        """An operation that runs on by itself (close() waits for it); its failure counts as seen."""
        op.add_done_callback(_retrieve)
        self._background.add(op)
        op.add_done_callback(self._background.discard)

    def outcome(self, tenant: str, cls: str, outcome: str) -> None:
        """Count one admission outcome (`metrics.ADMISSION`)."""
        key = (tenant, cls, outcome)
        child = self._outcomes.get(key)
        if child is None:
            if len(self._outcomes) >= _MAX_CHILDREN:
                self._outcomes.clear()
            child = self._outcomes[key] = metrics.ADMISSION.labels(tenant, cls, outcome)
        child.inc()

    def queue_time(self, tenant: str, cls: str, seconds: float) -> None:
        key = (tenant, cls)
        child = self._queue_times.get(key)
        if child is None:
            if len(self._queue_times) >= _MAX_CHILDREN:
                self._queue_times.clear()
            child = self._queue_times[key] = metrics.ADMISSION_QUEUE.labels(tenant, cls)
        child.observe(seconds)

    def redis_seconds(self, what: str) -> Any:
        child = self._seconds.get(what)
        if child is None:
            child = self._seconds[what] = metrics.REDIS_SECONDS.labels(what)
        return child

    def use_engines(self, snapshots: Callable[[], Any]) -> None:
        """Take the pool's capacity from the engine replicas' reports (`ports.ReplicaSnapshot`s)."""
        cfg = self.settings
        self.capacity = lambda: pool_capacity(snapshots(), cfg.capacity_factor, cfg.kv_high_water,
                                              cfg.unknown_replica_capacity)

    def capacity_now(self) -> int | None:
        if self.settings.pool_capacity:
            return self.settings.pool_capacity
        return self.capacity()

    def argv(self, *rest: Any) -> list[Any]:
        cap = self.capacity_now()
        spec = ""
        if cap is not None:
            headroom = int(cap * self.settings.fair_headroom)
            spec = f"{cap - headroom}:{headroom}:{self.settings.slot_hold_ms}"
        return [self._classes_arg, spec, self.router_id, int(self.settings.lease_ttl * 1000), *rest]

    def call(self, script: str, *args: Any) -> asyncio.Future[Any]:
        return asyncio.ensure_future(self._scripts[script](keys=[self._meta], args=self.argv(*args)))

    async def run(self, script: str, *args: Any) -> Any:
        """One script call, timed by `_watch`; Redis failures raise (the caller decides)."""
        return await self._watch(self.call(script, *args), script.lower())

    async def _watch(self, op: asyncio.Future[T], what: str) -> T:
        """`op`'s result within op_timeout of *Redis's* time. Never cancels `op` (a command cut off
        mid-reply would poison its connection); a caller cancelled here leaves it running."""
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        due = t0 + self.settings.op_timeout
        extensions = 0
        try:
            while True:
                await asyncio.wait((op,), timeout=max(0.0, due - loop.time()))
                if op.done():
                    return op.result()
                late = loop.time() - due
                if late <= _LATE and extensions < _MAX_EXTENSIONS:
                    # On time by the timer: confirm over two loop iterations (see `_Timed._check`).
                    probe = loop.time()
                    for _ in range(2):
                        await asyncio.sleep(0)
                    if op.done():
                        return op.result()
                    late = max(late, loop.time() - probe)
                if late <= _LATE or extensions >= _MAX_EXTENSIONS:
                    metrics.REDIS_FAILURES.labels(what, "timeout").inc()
                    raise asyncio.TimeoutError(f"no reply in {loop.time() - t0:.3f}s")
                # The timer ran late: the loop was stalled or saturated, and the reply may be waiting
                # in the socket. Give it the loop's lateness again (at least 0.1 s).
                extensions += 1
                due = loop.time() + min(self.settings.op_timeout, max(0.1, 2 * late))
        finally:
            self.redis_seconds(what).observe(loop.time() - t0)
            if not op.done():   # given up (timeout) or the caller cancelled: it runs on, tracked
                self._track(op)

    def _store_failure(self, exc: BaseException, what: str) -> TokenrelayError:
        if isinstance(exc, OutOfMemoryError):
            metrics.REDIS_FAILURES.labels(what, "oom").inc()
            return Reason.ADMISSION_STORE_FULL.error("the admission store is out of memory")
        if not isinstance(exc, asyncio.TimeoutError):
            metrics.REDIS_FAILURES.labels(what, "error").inc()
        return Reason.REDIS_UNAVAILABLE.error(f"admission store unreachable ({what})")

    def class_of(self, priority: int) -> str:
        cls = self._class_of.get(priority)
        if cls is None:
            cls = self._class_of[priority] = self.settings.class_for(priority)
        return cls

    # ---------------------------------------------------------------------------------- the API
    async def start(self) -> None:
        """Check the server, start the grant listener and the reaper (`admit` starts them too)."""
        try:
            info = await self._watch(asyncio.ensure_future(self.redis.info("server")), "ping")
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            log.warning("admission_store_unreachable_at_start", error=repr(exc))
        else:
            version = str(info.get("redis_version", "0"))
            if int(version.split(".")[0]) < 7:
                raise RuntimeError(f"the admission queue needs Redis 7.0 or newer (script flags); "
                                   f"{self.settings.redis_url} runs {version}")
        self.book.start()

    async def admit(self, req: AdmitRequest) -> Admitting:
        """Enqueue `req`: granted at once, queued, or refused with a typed reason and a retry-after."""
        self.book.start()
        cls = self.class_of(req.priority)
        cap = self.capacity_now()
        if cap == 0:
            raise Reason.NO_HEALTHY_REPLICA.error("no engine replica is serving")
        backlog = max(self.enqueues.behind(), self.settles.behind())
        if backlog > self.max_backlog:
            self.outcome(req.tenant, cls, _OVERLOADED)
            raise Reason.ROUTER_OVERLOADED.error(
                f"this router's admission calls wait {backlog * 1000:.0f} ms for their turn (limit "
                f"{self.max_backlog * 1000:.0f} ms): the process is behind",
                retry_after=min(2.0, 0.05 + 2 * backlog))
        member = f"{req.tenant}:{req.request_id}"
        waiter = Waiter(member, req, cls, os.urandom(6).hex())
        self.book.waiting[member] = waiter     # a grant message may come before the reply
        remaining_ms = int(req.deadline * 1000) if req.deadline > 0 else 0
        # A caller that gives up (cancelled, its deadline) or a call that times out while Redis may
        # still queue or grant it: once Redis answers, it is taken out again (`late`).
        fut = self.enqueues.add([member, cls, req.cost, remaining_ms, waiter.nonce, req.max_in_flight,
                                 req.max_queued, req.tokens_per_minute, req.weight,
                                 int(self.settings.max_queue_wait * 1000)],
                                late=lambda part: self._withdraw_after(part, waiter))
        try:
            # Not shielded: a cancelled caller cancels only its entry's future; the call goes on and
            # hands that entry's reply to `late`.
            reply = await fut
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            self.book.waiting.pop(member, None)
            return self._fail_open(req, cls, exc)
        except BaseException:
            self.book.waiting.pop(member, None)
            def withdraw(done: asyncio.Future[list[Any]]) -> None:
                if not done.cancelled() and done.exception() is None:
                    self._withdraw_after(done.result(), waiter)
            fut.add_done_callback(withdraw)
            raise
        status, value, extra = int(reply[0]), reply[1], int(reply[2])
        if status == 1:
            lease = self.book.granted(waiter, _s(value))
            self.outcome(req.tenant, cls, "granted")
            return Admitting(self, None, lease, 0)
        if status == 2:
            if waiter.lease is not None:          # granted by a message that raced the reply
                return Admitting(self, None, waiter.lease, 0)
            waiter.position = int(value)
            waiter.queued = True
            self.book.keep_alive()
            self.outcome(req.tenant, cls, "queued")
            return Admitting(self, waiter, None, int(value))
        self.book.waiting.pop(member, None)
        raise self._refusal(_s(value), extra, req, cls)

    def _refusal(self, name: str, retry_ms: int, req: AdmitRequest, cls: str) -> TokenrelayError:
        reason = Reason.lookup(name)
        self.outcome(req.tenant, cls, name.lower())
        if reason is None or reason not in _REFUSAL_TEXT:
            return Reason.INTERNAL.error(f"admission refused with an unknown reason {name!r}")
        text = _REFUSAL_TEXT[reason].format(id=req.request_id, t=req.tenant, mi=req.max_in_flight,
                                          mq=req.max_queued, c=cls, tpm=req.tokens_per_minute, cost=req.cost)
        return reason.error(text, retry_after=retry_ms / 1000 if retry_ms > 0 else None)

    def _fail_open(self, req: AdmitRequest, cls: str, exc: BaseException) -> Admitting:
        error = self._store_failure(exc, "enqueue")
        if not self.settings.fail_open:
            raise error from exc
        metrics.ADMISSION_FAIL_OPEN.inc()
        log.warning("admission_fail_open", error=repr(exc), tenant=req.tenant)
        return Admitting(self, None, self.local.admit(req, cls, self.capacity_now()), 0)

    def _withdraw_after(self, part: list[Any], waiter: Waiter) -> None:
        """The enqueue of an abandoned request ran after all (`part` is its reply): take it out."""
        status, value = int(part[0]), part[1]
        if status == 1:
            log.info("lease_released_after_abandoned_enqueue", member=waiter.member)
            self._spawn(self.book.granted(waiter, _s(value)).settle_tokens(0))
        elif status == 2:
            self._spawn(self._withdraw(waiter))

    async def _withdraw(self, waiter: Waiter) -> None:
        """Take an abandoned request out of the queue; a grant that raced in is settled at zero."""
        self.book.waiting.pop(waiter.member, None)
        self.book.ended(waiter.member)
        if waiter.lease is not None:
            await waiter.lease.settle_tokens(0)
            return
        try:
            reply = await self.run("CANCEL", waiter.member, waiter.nonce)
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            # Its keep-alive is no longer sent: Redis drops it within --lease-ttl.
            log.warning("queue_cancel_failed", member=waiter.member, error=repr(exc))
            return
        self.book.notices(reply[2:])
        if int(reply[0]) == 2:   # granted meanwhile
            await self.book.granted(waiter, _s(reply[1])).settle_tokens(0)

    async def depths(self) -> dict[str, int]:
        reply = await self.run("REAP")
        self.book.notices(reply[len(self.classes):])
        return {c.name: int(n) for c, n in zip(self.classes, reply, strict=False)}

    async def in_flight(self, tenant: str) -> int:
        return int(await self.redis.zcard(f"tq:{{{self.settings.pool}}}:tl:{tenant}"))

    async def ping(self) -> None:
        await self._watch(asyncio.ensure_future(self.redis.ping()), "ping")

    async def close(self) -> None:
        await self.book.close()
        if self._background:
            await asyncio.wait(set(self._background), timeout=self.settings.op_timeout)
            for op in list(self._background):   # an operation Redis never answered
                op.cancel()
        await self.redis.aclose()


def pool_capacity(snapshots: Any, factor: float, kv_high_water: float, unknown: int) -> int:
    """Requests the engine pool takes at once: each serving replica's running-batch size (its
    reported max_active, or `unknown` before its first report) times `factor`; a replica whose
    KV cache is above `kv_high_water` takes no more than it runs now."""
    total = 0.0
    for s in snapshots:
        if not (s.healthy and s.serving):
            continue
        slots = float(s.max_active or unknown) * factor
        if s.kv_total and s.kv_used >= kv_high_water * s.kv_total:
            slots = min(slots, float(s.active))
        total += slots
    return int(total + 0.5) if total else 0
