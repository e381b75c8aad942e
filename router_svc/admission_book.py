"""What one router process holds in the admission queue, kept by three tasks for all of it.

- `Book`: every lease and queued request of this process. One heartbeat call per tick extends
  all of them (queued requests are also told their position, and a grant whose message was
  lost is found), retries failed settlements, and restores what a Redis that lost its data
  forgot. One listener receives grants for this process's queued requests; one reaper calls the
  housekeeping script every --reap-interval. None of it is per request.
- `Waiter`: a queued request, woken on a grant, a position change or its failure.
- `Lease`: a granted request; `settle(usage)` charges the actual tokens and frees it (once).
- `LocalLimits`: the fail-open fallback, this process's own per-tenant and pool counts.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import random
import time
from typing import TYPE_CHECKING, Any

from redis.exceptions import RedisError

from services.errors import Reason, TokenrelayError
from services.logging import get_logger
from services.tasks import OwnedTask

from . import metrics
from .cluster_redis import subscribe
from .ports import AdmitRequest
from .types import Usage

if TYPE_CHECKING:
    from .admission import Admission

log = get_logger(__name__)
_GONE = {"deadline": (Reason.DEADLINE_EXCEEDED, "the deadline passed while queued"),
         "late": (Reason.DEADLINE_EXCEEDED, "its turn came with too little of its deadline left to be served "
                                            "(the pool's long request time, at most half the time it had left "
                                            "when queued): it left the queue instead of taking a slot"),
         "lost": (Reason.QUEUE_ENTRY_LOST, "the queue entry expired (this router missed its keep-alives)"),
         "cancelled": (Reason.CANCELLED, "cancelled while queued"),
         "refused": (Reason.CANCELLED, "refused")}


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class Waiter:
    """A queued request of this process."""

    def __init__(self, member: str, req: AdmitRequest, cls: str, nonce: str) -> None:
        self.member, self.req, self.cls, self.nonce = member, req, cls, nonce
        self.position = 0
        self.queued = False         # Redis answered "queued": from then on the heartbeat keeps it alive
        self.lease: Lease | None = None
        self.error: TokenrelayError | None = None
        self.t_queued = time.monotonic()
        self._event = asyncio.Event()

    async def changed(self) -> None:
        await self._event.wait()
        self._event.clear()

    def moved(self, position: int) -> None:
        if position != self.position and self.lease is None and self.error is None:
            self.position = position
            self._event.set()

    def fail(self, error: TokenrelayError) -> None:
        if self.lease is None and self.error is None:
            self.error = error
            self._event.set()


class Lease:
    """A granted request: heartbeated by its process's `Book` until settled."""

    def __init__(self, book: Book, waiter: Waiter, fence: str) -> None:
        self._book = book
        self.member, self.fence, self.cls, self.req = waiter.member, fence, waiter.cls, waiter.req
        self.nonce = waiter.nonce
        self._settled = False

    async def settle(self, usage: Usage) -> None:
        await self.settle_tokens(usage.prompt_tokens + usage.completion_tokens)

    async def settle_tokens(self, tokens: int) -> None:
        """Charge `tokens` (actual usage) and free the lease; idempotent, runs to the end when the
        caller is cancelled; a failure is retried by the heartbeat loop until the lease would
        have expired anyway (never raised: the request is over either way)."""
        if self._settled:
            return
        self._settled = True
        self._book.leases.pop(self.member, None)
        self._book.ended(self.member)
        metrics.LEASES_HELD.dec()
        # No task per settle: the batched call's future, shielded (a cancelled caller leaves it running);
        # its outcome is booked by a callback either way.
        fut = self._book.settle_call(self, tokens)
        with contextlib.suppress(RedisError, OSError, asyncio.TimeoutError):
            await asyncio.shield(fut)


class LocalLease:
    """A fail-open grant: counted by this process only."""

    def __init__(self, limits: LocalLimits, tenant: str) -> None:
        self._limits, self._tenant, self._settled = limits, tenant, False

    async def settle(self, usage: Usage) -> None:
        await self.settle_tokens(0)

    async def settle_tokens(self, tokens: int) -> None:
        if not self._settled:
            self._settled = True
            self._limits.release(self._tenant)


class LocalLimits:
    """Fail-open admission: the tenant's max_in_flight and the pool capacity, this process only."""

    def __init__(self) -> None:
        self._tenants: dict[str, int] = {}
        self.total = 0

    def admit(self, req: AdmitRequest, cls: str, capacity: int | None) -> LocalLease:
        held = self._tenants.get(req.tenant, 0)
        if held >= req.max_in_flight or (capacity is not None and self.total >= capacity):
            metrics.ADMISSION.labels(req.tenant, cls, "tenant_concurrency_limit").inc()
            raise Reason.TENANT_CONCURRENCY_LIMIT.error(
                f"tenant {req.tenant!r} has {req.max_in_flight} requests in flight on this router "
                "(admission store unreachable: local limits)")
        self._tenants[req.tenant] = held + 1
        self.total += 1
        return LocalLease(self, req.tenant)

    def release(self, tenant: str) -> None:
        self._tenants[tenant] = max(0, self._tenants.get(tenant, 0) - 1)
        self.total = max(0, self.total - 1)


class Book:
    def __init__(self, admission: Admission) -> None:
        self.admission = admission
        self.leases: dict[str, Lease] = {}
        self.waiting: dict[str, Waiter] = {}
        self._pending: dict[str, tuple[Lease, int, float]] = {}  # failed settles -> tokens, give up at
        # Requests that ended here lately (member -> forget at): a grant notice for one of them is a
        # heartbeat's or a message's late echo of a grant already settled, not an abandoned grant.
        # Each member's time is also queued in order (one TTL for all: FIFO order is expiry order), so
        # forgetting is amortized O(1) per request, never a scan of every request of the last 2 TTLs.
        self._ended: dict[str, float] = {}
        self._ended_order: collections.deque[tuple[float, str]] = collections.deque()
        self._beat = OwnedTask("admission-heartbeats")
        self._listener = OwnedTask("admission-grants")
        self._reaper = OwnedTask("admission-reaper")
        self.listening = asyncio.Event()

    def start(self) -> None:
        self._listener.ensure(self._listen)
        self._reaper.ensure(self._reap)

    # ------------------------------------------------------------------------- grants and notices
    def granted(self, waiter: Waiter, fence: str) -> Lease:
        self.waiting.pop(waiter.member, None)
        if waiter.queued:          # out of its tenant's queue: a slot there may be free
            self.admission.queue_memo.freed(waiter.req.tenant)
        if waiter.lease is None:
            waiter.lease = Lease(self, waiter, fence)
            self.leases[waiter.member] = waiter.lease
            metrics.LEASES_HELD.inc()
            self.admission.queue_time(waiter.req.tenant, waiter.cls, time.monotonic() - waiter.t_queued)
            waiter._event.set()
            self.keep_alive()
        return waiter.lease

    def notices(self, flat: list[Any]) -> None:
        """(member, fence, why) triples from a script: grants and removals of this process's requests."""
        for i in range(0, len(flat) - 2, 3):
            self.notice(_s(flat[i]), _s(flat[i + 1]), _s(flat[i + 2]))

    def ended(self, member: str) -> None:
        now = time.monotonic()
        forget_at = now + 2 * self.admission.settings.lease_ttl
        self._ended[member] = forget_at
        order = self._ended_order
        order.append((forget_at, member))
        while order[0][0] <= now:
            at, old = order.popleft()
            if self._ended.get(old) == at:
                del self._ended[old]

    def notice(self, member: str, fence: str, why: str) -> None:
        waiter = self.waiting.get(member)
        if why == "grant":
            if waiter is not None:
                self.granted(waiter, fence)
            elif member not in self.leases and self._ended.get(member, 0.0) < time.monotonic():
                # its request was abandoned before the grant reached it: give the capacity back
                log.info("grant_for_abandoned_request", member=member)
                self.admission._spawn(self._settle_orphan(member, fence))
            return
        if waiter is not None:
            self.waiting.pop(member, None)
            if waiter.queued:
                self.admission.left_queue(waiter.req)
            reason, text = _GONE.get(why, _GONE["lost"])
            waiter.fail(reason.error(text))

    async def _settle_orphan(self, member: str, fence: str) -> None:
        try:
            await self.admission.settles.add([member, fence, 0, 0, 1])
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            log.warning("orphan_settle_failed", member=member, error=repr(exc))

    # ----------------------------------------------------------------------------- settlement
    def settle_call(self, lease: Lease, tokens: int) -> asyncio.Future[list[Any]]:
        req = lease.req
        fut = self.admission.settles.add([lease.member, lease.fence, tokens, req.tokens_per_minute, req.weight])
        self.admission.memo.refunded(req.tenant, req.cost - tokens)     # used less than its estimate
        fut.add_done_callback(lambda done: self._settled(lease, tokens, done))
        return fut

    async def settle(self, lease: Lease, tokens: int) -> None:
        with contextlib.suppress(RedisError, OSError, asyncio.TimeoutError):
            await self.settle_call(lease, tokens)

    def _settled(self, lease: Lease, tokens: int, done: asyncio.Future[list[Any]]) -> None:
        exc = None if done.cancelled() else done.exception()
        if done.cancelled() or exc is not None:
            log.warning("lease_settle_failed", member=lease.member, error=repr(exc), retry="heartbeat loop")
            self._pending[lease.member] = (lease, tokens, time.monotonic() + self.admission.settings.lease_ttl)
            metrics.LEASE_RELEASE_RETRIES.inc()
            self.keep_alive()
            return
        self._pending.pop(lease.member, None)
        status = int(done.result()[0])
        if status == 0:
            log.warning("lease_settle_refused", member=lease.member, why="fenced off: another request of this "
                        "id holds it, or its record is gone")
        elif status == 2:
            log.info("lease_settled_after_expiry", member=lease.member)
        elif status == 3:
            log.debug("lease_settled_already", member=lease.member)   # a retry of a settle that landed

    # ----------------------------------------------------------------------------- heartbeats
    def keep_alive(self) -> None:
        """A request was queued or granted: make sure the heartbeat loop runs."""
        self._beat.ensure(self._run)

    async def _run(self) -> None:
        settings = self.admission.settings
        while self.leases or self.waiting or self._pending:
            await asyncio.sleep(settings.queue_poll if self.waiting else settings.heartbeat)
            await self.tick()

    async def tick(self) -> None:
        """One round: retry failed settlements, then extend / check everything held, in one call."""
        now = time.monotonic()
        retries = []
        for member, (lease, tokens, give_up) in list(self._pending.items()):
            if now > give_up:
                self._pending.pop(member, None)
            else:    # all in one batched call, not one round trip after another
                retries.append(self.settle(lease, tokens))
        if retries:
            await asyncio.gather(*retries)
        if not self.leases and not self.waiting:
            return
        args: list[Any] = [len(self.leases)]
        for lease in self.leases.values():
            r = lease.req
            args += [lease.member, lease.fence, lease.cls, r.cost, r.max_in_flight, r.max_queued,
                     r.tokens_per_minute, r.weight]
        waiters = [w for w in self.waiting.values() if w.queued]
        args.append(len(waiters))
        for w in waiters:
            r = w.req
            args += [w.member, w.nonce, w.cls, r.cost, 0, r.max_in_flight, r.max_queued, r.tokens_per_minute,
                     r.weight]
        try:
            reply = await self.admission.run("BEAT", *args)
        except (RedisError, OSError, asyncio.TimeoutError) as exc:  # the next tick tries again
            log.warning("admission_heartbeat_failed", leases=len(self.leases), queued=len(waiters), error=repr(exc))
            return
        self._depths(reply)
        rest = reply[len(self.admission.classes):]
        grants: list[Any] = []
        for i in range(0, len(rest) - 2, 3):
            kind, member, value = _s(rest[i]), _s(rest[i + 1]), rest[i + 2]
            if kind == "lost":
                if member in self.leases:    # (one settled while this heartbeat was on its way is not)
                    log.warning("lease_lost", member=member)
            elif kind == "pos":
                if member in self.waiting:
                    self.waiting[member].moved(int(value))
            elif kind == "gone":
                self.notice(member, "-1", _s(value))
            else:
                grants += [kind, member, value]
        self.notices(grants)

    def _depths(self, reply: list[Any]) -> None:
        for c, n in zip(self.admission.classes, reply, strict=False):
            metrics.QUEUE_DEPTH.labels(c.name).set(int(n))

    # --------------------------------------------------------------------- listener and reaper
    async def _listen(self) -> None:
        adm = self.admission
        while True:
            pubsub = adm.redis.pubsub(ignore_subscribe_messages=True)
            try:
                async with asyncio.timeout(adm.settings.op_timeout):
                    await subscribe(adm.redis, pubsub, adm.channel)
                self.listening.set()
                async for message in pubsub.listen():
                    if message.get("type") == "message":
                        member, fence, why = _s(message["data"]).split("\n")
                        self.notice(member, fence, why)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                task = asyncio.current_task()
                if task is not None and task.cancelling():   # a cancel that redis-py's own wait swallowed
                    raise asyncio.CancelledError from exc
                self.listening.clear()
                log.warning("admission_listener_failed", error=repr(exc))
                await asyncio.sleep(min(1.0, adm.settings.op_timeout))
            finally:
                try:
                    await asyncio.shield(pubsub.aclose())
                except Exception:  # noqa: BLE001 - a dead connection
                    pass

    async def _reap(self) -> None:
        interval = self.admission.settings.reap_interval
        while True:
            await asyncio.sleep(interval * random.uniform(0.8, 1.2))
            try:
                reply = await self.admission.run("REAP")
            except (RedisError, OSError, asyncio.TimeoutError) as exc:
                log.debug("admission_reap_failed", error=repr(exc))
                continue
            self._depths(reply)
            self.notices(reply[len(self.admission.classes):])

    async def close(self) -> None:
        await self._beat.close()
        await self._listener.close()
        await self._reaper.close()
