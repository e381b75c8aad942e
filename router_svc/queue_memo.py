"""Which tenants' queues Redis last told this router were full, so that the tenant's next requests
are refused here without a Redis call (`--queue-memo-ms`).

A tenant that floods the pool past its `max_queued` otherwise costs a Redis round trip per request,
only to be told TENANT_QUEUE_FULL again; at 3x overload those refusals were a third of all
refusals, and their time to the client (an ENQUEUE round trip through two busy event loops) was
the refusal tail (issue 11, `docs/admission.md`).

A tenant's queue is known full here when Redis said so: a TENANT_QUEUE_FULL refusal, or an ENQUEUE
that queued a request and reported that the tenant's queue is full with it (`queue_lua.py`). It
stays known full until

- one of the tenant's requests queued at *this* router leaves the queue (granted, cancelled,
  withdrawn, expired: `freed`): a slot may be free, the next request asks Redis;
- `ttl` seconds pass: a slot freed at *another* router is not seen here, so for at most that long
  this router may refuse a request that Redis would have queued. With one router the memo is exact
  but for that (a queued request is only ever this router's); with several, the others' own
  arrivals take the slots their grants free, and each router asks Redis again within `ttl`;
- the tenant's `max_queued` changes (a tenants file reload), or a request of another class asks
  (the script grants some requests before it looks at the queue's length: only the class Redis
  refused is refused here).
"""

from __future__ import annotations

from dataclasses import dataclass

from .tenant_memo import TenantMemo

MIN_RETRY_MS = 100     # the script's own floor for a full queue's retry-after


@dataclass(slots=True)
class _Full:
    cls: str
    max_queued: int
    until: float
    asked_at: float
    retry_ms: int


class QueueMemo(TenantMemo[_Full]):
    """Per tenant, the class in which Redis last reported its queue full (bounded, expiring)."""

    def full(self, tenant: str, cls: str, max_queued: int, retry_ms: int, asked_at: float) -> None:
        """Redis reported the tenant's queue full (`max_queued` requests) for a request of class
        `cls` this router asked about at `asked_at` (taken before the call was sent)."""
        if self.ttl <= 0 or max_queued <= 0:
            return
        self._put(tenant, _Full(cls, max_queued, asked_at + self.ttl, asked_at, max(retry_ms, MIN_RETRY_MS)))

    def freed(self, tenant: str) -> None:
        """One of the tenant's requests queued here left the queue: a slot may be free."""
        self._entries.pop(tenant, None)

    def refusal(self, tenant: str, cls: str, max_queued: int) -> int | None:
        """The retry-after (ms) of a refusal of the tenant's request of class `cls`, if its queue is
        known full; None when it may have room, or nothing is known."""
        entry = self._entries.get(tenant)
        if entry is None:
            return None
        now = self._clock()
        if now >= entry.until or entry.max_queued != max_queued:
            del self._entries[tenant]
            return None
        if entry.cls != cls:
            return None
        return max(MIN_RETRY_MS, entry.retry_ms - int((now - entry.asked_at) * 1000))
