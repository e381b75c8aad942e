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
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError, RedisError

from services.errors import Reason, TokenrelayError
from services.logging import get_logger

from . import metrics, queue_lua
from .admission_book import Book, Lease, LocalLease, LocalLimits, Waiter
from .admission_settings import AdmissionSettings
from .ports import AdmitRequest

__all__ = ["Admission", "AdmissionSettings", "Admitting", "Lease"]

log = get_logger(__name__)
T = TypeVar("T")

# The loop is "late" when a timer fires more than this after it was due: then an operation's
# time ran on the loop, not in Redis, and it gets more time (at most _MAX_EXTENSIONS times).
_LATE = 0.02
_MAX_EXTENSIONS = 8
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


class Batcher:
    """Calls of one script submitted in the same event-loop iteration go out as ONE call: one round
    trip, one script start, one pack of the arguments — under load a call carries many requests.

    `add(args)` returns a future of this entry's slice of the reply (`width` values); the grants
    that follow the entries go to the book. A caller that stops waiting leaves its entry in the
    call; `late(slice)`, when given, receives the slice of an entry whose caller stopped waiting or
    whose call timed out and then ran after all."""

    def __init__(self, admission: Admission, script: str, width: int, max_batch: int = 128) -> None:
        self._admission, self._script, self._width, self._max = admission, script, width, max_batch
        self._pending: list[tuple[list[Any], asyncio.Future[list[Any]], Callable[[list[Any]], None] | None]] = []
        self._scheduled = False

    def add(self, args: list[Any], late: Callable[[list[Any]], None] | None = None) -> asyncio.Future[list[Any]]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[list[Any]] = loop.create_future()
        self._pending.append((args, fut, late))
        if not self._scheduled:
            self._scheduled = True
            loop.call_soon(self._flush)
        return fut

    def _flush(self) -> None:
        self._scheduled = False
        while self._pending:
            batch, self._pending = self._pending[:self._max], self._pending[self._max:]
            self._admission._spawn(self._send(batch))

    async def _send(self, batch: list[tuple[list[Any], asyncio.Future[list[Any]], Any]]) -> None:
        flat: list[Any] = [len(batch)]
        for args, _, _ in batch:
            flat.extend(args)
        op = self._admission.call(self._script, *flat)
        try:
            reply = await self._admission._watch(op, self._script.lower())
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            for _, fut, _ in batch:
                if not fut.done():
                    fut.set_exception(exc)
            op.add_done_callback(lambda done: self._ran_late(done, batch))
            return
        self._deliver(reply, batch, late_only=False)

    def _ran_late(self, op: asyncio.Future[Any], batch: list[Any]) -> None:
        if not op.cancelled() and op.exception() is None:
            self._deliver(op.result(), batch, late_only=True)

    def _deliver(self, reply: list[Any], batch: list[Any], late_only: bool) -> None:
        w = self._width
        for i, (_, fut, late) in enumerate(batch):
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
        pool = aioredis.BlockingConnectionPool.from_url(
            settings.redis_url, max_connections=settings.max_connections, timeout=backstop,
            socket_timeout=backstop, socket_connect_timeout=settings.op_timeout, health_check_interval=30,
            retry=Retry(NoBackoff(), 1), retry_on_error=[RedisConnectionError], **settings.redis_options())
        self.redis = aioredis.Redis.from_pool(pool)
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
        self.enqueues = Batcher(self, "ENQUEUE", 3)
        self.settles = Batcher(self, "SETTLE", 1)
        self.local = LocalLimits()
        self._background: set[asyncio.Future[Any]] = set()

    # --------------------------------------------------------------------------------- plumbing
    def _spawn(self, coro: Awaitable[T]) -> asyncio.Task[T]:
        task: asyncio.Task[T] = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

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
                if late <= _LATE or extensions >= _MAX_EXTENSIONS:
                    metrics.REDIS_FAILURES.labels(what, "timeout").inc()
                    raise asyncio.TimeoutError(f"no reply in {loop.time() - t0:.3f}s")
                # The timer ran late: the loop was stalled or saturated, and the reply may be waiting
                # in the socket. Give it the loop's lateness again (at least 0.1 s).
                extensions += 1
                due = loop.time() + min(self.settings.op_timeout, max(0.1, 2 * late))
        finally:
            metrics.REDIS_SECONDS.labels(what).observe(loop.time() - t0)
            if not op.done():   # given up (timeout) or the caller cancelled: it runs on, tracked
                op.add_done_callback(_retrieve)
                self._background.add(op)
                op.add_done_callback(self._background.discard)

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
        member = f"{req.tenant}:{req.request_id}"
        waiter = Waiter(member, req, cls, uuid.uuid4().hex[:12])
        self.book.waiting[member] = waiter     # a grant message may come before the reply
        remaining_ms = int(req.deadline * 1000) if req.deadline > 0 else 0
        # A caller that gives up (cancelled, its deadline) or a call that times out while Redis may
        # still queue or grant it: once Redis answers, it is taken out again (`late`).
        fut = self.enqueues.add([member, cls, req.cost, remaining_ms, waiter.nonce, req.max_in_flight,
                                 req.max_queued, req.tokens_per_minute, req.weight,
                                 int(self.settings.max_queue_wait * 1000)],
                                late=lambda part: self._withdraw_after(part, waiter))
        try:
            reply = await asyncio.shield(fut)
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
            metrics.ADMISSION.labels(req.tenant, cls, "granted").inc()
            return Admitting(self, None, lease, 0)
        if status == 2:
            if waiter.lease is not None:          # granted by a message that raced the reply
                return Admitting(self, None, waiter.lease, 0)
            waiter.position = int(value)
            waiter.queued = True
            self.book.keep_alive()
            metrics.ADMISSION.labels(req.tenant, cls, "queued").inc()
            return Admitting(self, waiter, None, int(value))
        self.book.waiting.pop(member, None)
        raise self._refusal(_s(value), extra, req, cls)

    def _refusal(self, name: str, retry_ms: int, req: AdmitRequest, cls: str) -> TokenrelayError:
        reason = Reason.lookup(name)
        metrics.ADMISSION.labels(req.tenant, cls, name.lower()).inc()
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
