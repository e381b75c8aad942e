"""What a tenant's token budget owed when Redis last refused it, so that a router can refuse the
tenant's next requests that cannot fit either without asking again (`--budget-memo-ms`).

A tenant far past its `tokens_per_minute` (a retry loop, a runaway batch job) otherwise costs a
Redis round trip, an id claim and a Tokenize call per request, only to be told the same thing; at
3x overload those refusals were half of a router's work (issue 11). Redis keeps the budget as GCRA
over tokens (`queue_lua.py`): a request of `cost` tokens waits

    wait = debt + cost * 60000 / tpm        (ms; refused when wait > the request's wait limit)

where `debt` is the tenant's theoretical arrival time plus its queued requests' cost, less a
minute, less now. A refusal's retry-after is that wait rounded up, so the router learns
`debt >= retry_after - 1 - cost * 60000 / tpm` at the moment the script ran. The debt then falls by
one ms per ms (the budget refills) and by refunds (a settle below the estimate, a queued request
that left); it rises with every request admitted. So for a later request whose cost is at least
`least` tokens:

    wait >= debt_then - (now - asked_at) + admitted_here - refunds_seen_here + least * 60000 / tpm

and when that lower bound is past the request's own limit, Redis would refuse it too.
`admitted_here` counts only requests this router sent after the refusal came back (Redis ran them
after it, so they are not in `debt_then`); every refund seen here is taken off, even one of a
request whose cost `debt_then` may not hold: the bound only gets lower. The limit is
the script's: min(max_queue_wait, its remaining time less min(long lease, half of it)), with the
pool's long lease the refusal reported (the mean lease plus twice the leases' mean absolute
deviation: averages over many leases, which move little within a memo's life), and the request's
remaining time now (the script would see less). `asked_at` is taken before the call was sent, so
the time elapsed is over-counted, never under. What this router cannot see is a refund or a
withdrawn queued request at *another* router: an entry lives at most `ttl`
seconds, so such a refund is seen at the next round trip, after at most that long.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .tenant_memo import TenantMemo


@dataclass(slots=True)
class _Entry:
    asked_at: float     # this router's clock, before the refused call was sent
    debt_ms: float      # a lower bound of the tenant's budget debt then (ms of refill)
    tpm: int
    until: float
    replied_at: float   # when the refusal came back: admissions asked for after it came after it
    lease_ms: float     # the pool's long lease the script set aside from a deadline


class BudgetMemo(TenantMemo[_Entry]):
    """Per tenant, the last token-budget refusal Redis gave this router (bounded, expiring)."""

    def refused(self, tenant: str, tpm: int, cost: int, retry_ms: int, asked_at: float, lease_ms: float = 0) -> None:
        """Redis refused a request of `cost` tokens with TOKEN_RATE_LIMITED and `retry_ms`, setting
        `lease_ms` aside from deadlines."""
        if self.ttl <= 0 or tpm <= 0 or retry_ms <= 0:
            return
        self._put(tenant, _Entry(asked_at, retry_ms - 1 - cost * 60000 / tpm, tpm, asked_at + self.ttl,
                                 self._clock(), max(0.0, lease_ms)))

    def admitted(self, tenant: str, cost: int, asked_at: float) -> None:
        """Redis granted or queued a request of the tenant that this router asked for at `asked_at`:
        its cost is charged to the budget (counted only when asked for after the refusal came back)."""
        entry = self._entries.get(tenant)
        if entry is not None and asked_at > entry.replied_at:
            entry.debt_ms += cost * 60000 / entry.tpm

    def refunded(self, tenant: str, tokens: int) -> None:
        """This router gave `tokens` of the tenant's budget back (a settle below the estimate, a
        queued request withdrawn). Charges above the estimate are not counted: the bound stays low."""
        entry = self._entries.get(tenant)
        if entry is not None and tokens > 0:
            entry.debt_ms -= tokens * 60000 / entry.tpm

    def wait_ms(self, tenant: str, tpm: int, least: int, remaining_ms: float, max_wait_ms: float) -> int | None:
        """The least wait (ms) Redis would give a request of at least `least` tokens with
        `remaining_ms` to its deadline (0 = none), if that is past the wait the script allows it
        (so Redis would refuse it); None when it might fit, or nothing is known."""
        entry = self._entries.get(tenant)
        if entry is None:
            return None
        now = self._clock()
        if now >= entry.until or entry.tpm != tpm:     # expired, or the tenant's budget changed
            del self._entries[tenant]
            return None
        limit_ms = max_wait_ms
        if remaining_ms > 0:
            limit_ms = min(max_wait_ms, max(1.0, remaining_ms - min(entry.lease_ms, remaining_ms / 2)))
        wait = entry.debt_ms - (now - entry.asked_at) * 1000 + least * 60000 / tpm
        if wait <= limit_ms:
            return None
        return math.ceil(wait)
