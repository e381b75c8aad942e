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

The hot path's client cost is per *call*, not per request, where it can be (`Batcher`, admission_calls.py): the
enqueues (and the settles) of one loop iteration share one call, at most a few calls of each
script are in flight (what arrives meanwhile goes in the next, larger one), and a call is timed
by one timer and callbacks (`Timed`, admission_calls.py), with no task or `asyncio.wait` of its own. A process that
falls behind (its loop busy all the time or late while calls wait for their turn beyond
min(0.25 s, op_timeout / 4)) refuses new requests at once with ROUTER_OVERLOADED and a
retry-after instead of queueing them behind calls that would time out (issue 11: before this,
5k requests/s on two single-core routers collapsed to 929/s with p50 10.9 s).
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError, RedisError, ResponseError

from services.errors import Reason, TokenrelayError
from services.logging import get_logger
from services.tasks import retrieve

from . import metrics, queue_lua
from .admission_book import Book, Lease, LocalLease, LocalLimits, Waiter
from .admission_calls import MAX_EXTENSIONS, Batcher, Timed
from .admission_settings import AdmissionSettings
from .budget_memo import BudgetMemo
from .cluster_redis import open_redis
from .ports import AdmitRequest
from .queue_memo import QueueMemo
from .redis_scripts import ScriptClient, open_lean

__all__ = ["Admission", "AdmissionSettings", "Admitting", "Lease"]

log = get_logger(__name__)
T = TypeVar("T")

# Longest wait of a hot-path call for its turn before new requests are refused (at most
# op_timeout / 4): see `Admission.max_backlog`.
_MAX_BACKLOG = 0.25
_OVERLOADED = Reason.ROUTER_OVERLOADED.value.lower()
_RATE_LIMITED = Reason.TOKEN_RATE_LIMITED.value
_QUEUE_FULL = Reason.TENANT_QUEUE_FULL.value
_REFUSAL_TEXT = {
    Reason.TENANT_CONCURRENCY_LIMIT: "tenant {t!r} has {mi} requests in flight (its limit) and may not queue more",
    Reason.TENANT_QUEUE_FULL: "tenant {t!r} has {mq} requests queued (its max_queued) and the engines are busy",
    Reason.CLASS_QUEUE_FULL: "the {c} queue is full",
    Reason.TOKEN_RATE_LIMITED: "tenant {t!r} is over its {tpm} tokens per minute",
    Reason.TOKEN_BUDGET_TOO_SMALL: "the request's estimate ({cost} tokens: prompt + max_tokens) exceeds tenant "
                                   "{t!r}'s whole budget of {tpm} tokens per minute; lower max_tokens",
    Reason.QUEUE_WAIT_EXCEEDS_DEADLINE: "the estimated queue wait exceeds the request's deadline",
}


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


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
        backstop = settings.op_timeout * (MAX_EXTENSIONS + 2)
        self.redis = open_redis(settings.redis_url, backstop, connect_timeout=settings.op_timeout,
                                max_connections=settings.max_connections, retry_on=[RedisConnectionError],
                                **settings.redis_options())
        self._scripts = {name: self.redis.register_script(getattr(queue_lua, name))
                         for name in ("ENQUEUE", "SETTLE", "CANCEL", "BEAT", "REAP")}
        # The scripts' calls on a connection of their own that writes each at once (redis_scripts.py).
        self.lean: ScriptClient | None = None
        if settings.redis_client == "lean":
            self.lean = open_lean(str(settings.redis_url), settings.redis_options(),
                                  connect_timeout=settings.op_timeout, stall_timeout=backstop)
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
        # Token-budget refusals Redis gave this process: the tenant's next requests that cannot fit
        # either are refused by `precheck` without a round trip (budget_memo.py).
        self.memo = BudgetMemo(settings.budget_memo_ms / 1000)
        # Tenants whose queue Redis reported full: their next requests are refused by `precheck`
        # without a round trip until one of theirs leaves the queue here (queue_memo.py).
        self.queue_memo = QueueMemo(settings.queue_memo_ms / 1000)
        self._background: set[asyncio.Future[Any]] = set()
        # Labelled metric children, looked up once per label set rather than once per request.
        self._outcomes: metrics.Kept[Any] = metrics.Kept(metrics.ADMISSION.labels)
        self._queue_times: metrics.Kept[Any] = metrics.Kept(metrics.ADMISSION_QUEUE.labels)
        self._seconds: metrics.Kept[Any] = metrics.Kept(metrics.REDIS_SECONDS.labels)

    # --------------------------------------------------------------------------------- plumbing
    def _spawn(self, coro: Awaitable[T]) -> asyncio.Task[T]:
        task: asyncio.Task[T] = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def _track(self, op: asyncio.Future[Any]) -> None:
        """An operation that runs on by itself (close() waits for it); its failure counts as seen."""
        op.add_done_callback(retrieve)   # its failure was already reported
        self._background.add(op)
        op.add_done_callback(self._background.discard)

    def outcome(self, tenant: str, cls: str, outcome: str) -> None:
        """Count one admission outcome (`metrics.ADMISSION`)."""
        self._outcomes.get(tenant, cls, outcome).inc()

    def queue_time(self, tenant: str, cls: str, seconds: float) -> None:
        self._queue_times.get(tenant, cls).observe(seconds)

    def redis_seconds(self, what: str) -> Any:
        return self._seconds.get(what)

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
        library = self.settings.queue_code == "library"
        s = self._scripts[script]
        if self.lean is not None:
            if library:   # run as the script when the library cannot be loaded (e.g. at maxmemory)
                return self.lean.fcall(queue_lua.FUNCTIONS[script], queue_lua.LIBRARY, (self._meta,),
                                       self.argv(*args), script=s.script)  # type: ignore[arg-type]
            return self.lean.call(s.sha, s.script, (self._meta,), self.argv(*args))  # type: ignore[arg-type]
        if library:
            return asyncio.ensure_future(self._fcall(script, self.argv(*args)))
        return asyncio.ensure_future(s(keys=[self._meta], args=self.argv(*args)))

    async def _fcall(self, script: str, argv: list[Any]) -> Any:
        """FCALL through redis-py (a cluster URL, `--redis-client redis-py`), the library loaded
        when Redis does not have it (on every primary of a cluster), the call run as its script when
        the library cannot be loaded (Redis at maxmemory refuses FUNCTION LOAD)."""
        name = queue_lua.FUNCTIONS[script]
        try:
            return await self.redis.fcall(name, 1, self._meta, *argv)
        except ResponseError as exc:
            if "Function not found" not in str(exc):
                raise
        try:
            await self.redis.function_load(queue_lua.LIBRARY, replace=True)
        except RedisError:
            return await self._scripts[script](keys=[self._meta], args=argv)
        return await self.redis.fcall(name, 1, self._meta, *argv)

    async def run(self, script: str, *args: Any) -> Any:
        """One script call, timed by `_watch`; Redis failures raise (the caller decides)."""
        return await self._watch(self.call(script, *args), script.lower())

    async def _watch(self, op: asyncio.Future[T], what: str) -> T:
        """`op`'s result within op_timeout of *Redis's* time (`Timed`'s rule, awaited). Never cancels
        `op` (a command cut off mid-reply would poison its connection); a caller cancelled here
        leaves it running, tracked."""
        verdict: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()

        def done(exc: BaseException | None) -> None:
            if not verdict.done():
                verdict.set_result(exc)
        Timed(self, None, op, what, done)
        try:
            exc = await verdict
        finally:
            if not op.done():   # given up (timeout) or the caller cancelled: it runs on, tracked
                self._track(op)
        if exc is not None:
            raise exc
        return op.result()

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

    def precheck(self, req: AdmitRequest) -> None:
        """Refuse at once, with no Redis call, what Redis would refuse: for the tenant's token budget
        (`req.cost`: the least the request can cost, before its prompt is tokenized), a request larger
        than the whole budget, or one that cannot fit the budget Redis refused within --budget-memo-ms;
        and a request of a tenant whose queue Redis reported full (--queue-memo-ms)."""
        known = self._known_refusal(req)
        if known is not None:
            raise self._refusal(*known, req, self.class_of(req.priority), local=True)
        if req.max_queued > 0 and len(self.queue_memo):
            cls = self.class_of(req.priority)
            retry_ms = self.queue_memo.refusal(req.tenant, cls, req.max_queued)
            if retry_ms is not None:
                raise self._refusal(_QUEUE_FULL, retry_ms, req, cls, local=True)

    def predicts_refusal(self, req: AdmitRequest) -> bool:
        """Would `precheck` refuse `req` (its cost an estimate here, not the least)? Nothing is counted."""
        return self._known_refusal(req) is not None

    def _known_refusal(self, req: AdmitRequest) -> tuple[str, int] | None:
        tpm = req.tokens_per_minute
        if tpm <= 0:
            return None
        if req.cost > tpm:
            return Reason.TOKEN_BUDGET_TOO_SMALL.value, 0
        wait = self.memo.wait_ms(req.tenant, tpm, req.cost, req.deadline * 1000, self.settings.max_queue_wait * 1000)
        return None if wait is None else (_RATE_LIMITED, wait)

    async def admit(self, req: AdmitRequest) -> Admitting:
        """Enqueue `req`: granted at once, queued, or refused with a typed reason and a retry-after."""
        asked_at = time.monotonic()
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
        # The entry is this call's own (its nonce in the name): an admission started before the id
        # claim was answered (the router's early admission) never touches another router's entry
        # of the same id. Retried script calls keep the name, so they still count once.
        nonce = os.urandom(6).hex()
        member = f"{req.tenant}:{req.request_id}~{nonce}"
        waiter = Waiter(member, req, cls, nonce)
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
        if status != 0 and req.tokens_per_minute > 0:
            self.memo.admitted(req.tenant, req.cost, asked_at)
        if status == 1:
            lease = self.book.granted(waiter, _s(value))
            self.outcome(req.tenant, cls, "granted")
            return Admitting(self, None, lease, 0)
        if status == 2:
            position = value
            if isinstance(value, (bytes, str)):   # '<position>/full': the tenant's queue is full with it
                position, _, full = _s(value).partition("/")
                if full:
                    self.queue_memo.full(req.tenant, cls, req.max_queued, extra, asked_at)
            if waiter.lease is not None:          # granted by a message that raced the reply
                return Admitting(self, None, waiter.lease, 0)
            waiter.position = int(position)
            waiter.queued = True
            self.book.keep_alive()
            self.outcome(req.tenant, cls, "queued")
            return Admitting(self, waiter, None, waiter.position)
        self.book.waiting.pop(member, None)
        name = _s(value)
        if name.startswith(_RATE_LIMITED):     # with the long lease the script set aside: NAME/ms
            name, _, lease_ms = name.partition("/")
            self.memo.refused(req.tenant, req.tokens_per_minute, req.cost, extra, asked_at, float(lease_ms or 0))
        elif name == _QUEUE_FULL:
            self.queue_memo.full(req.tenant, cls, req.max_queued, extra, asked_at)
        raise self._refusal(name, extra, req, cls)

    def _refusal(self, name: str, retry_ms: int, req: AdmitRequest, cls: str, local: bool = False) -> TokenrelayError:
        reason = Reason.lookup(name)
        self.outcome(req.tenant, cls, name.lower())
        if local:
            metrics.ADMISSION_LOCAL_REFUSALS.labels(name.lower()).inc()
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

    def left_queue(self, req: AdmitRequest) -> None:
        """A request queued here left the queue without a grant (withdrawn, dropped): its cost no longer
        counts against its tenant's budget, and its place in the tenant's queue is free."""
        self.memo.refunded(req.tenant, req.cost)
        self.queue_memo.freed(req.tenant)

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
        if int(reply[0]) == 1:   # out of the queue
            self.left_queue(waiter.req)
        elif int(reply[0]) == 2:   # granted meanwhile
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
        if self.lean is not None:
            await self.lean.close()
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
