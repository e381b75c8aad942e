"""A bounded, expiring table of one entry per tenant, shared by the router's refusal memos
(`budget_memo.py`, `queue_memo.py`): at most `max_tenants` entries; a new entry first pushes out
the expired ones, then the oldest (the dict's insertion order is the age order)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

MAX_TENANTS = 10_000


class _Expiring(Protocol):
    until: float


E = TypeVar("E", bound=_Expiring)


class TenantMemo(Generic[E]):
    def __init__(self, ttl: float, clock: Callable[[], float] = time.monotonic,
                 max_tenants: int = MAX_TENANTS) -> None:
        self.ttl = ttl
        self._clock = clock
        self._max = max_tenants
        self._entries: dict[str, E] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def _put(self, tenant: str, entry: E) -> None:
        entries = self._entries
        entries.pop(tenant, None)          # re-inserted last: the dict's order is the age order
        if len(entries) >= self._max:
            now = self._clock()
            for name in [n for n, e in entries.items() if e.until <= now]:
                del entries[name]
            while len(entries) >= self._max:
                del entries[next(iter(entries))]
        entries[tenant] = entry
