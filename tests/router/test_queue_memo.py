"""The full-queue memo (router_svc/queue_memo.py): pure logic on a fake clock, then against a real
redis-server — with one router, what the memo refuses Redis refuses too, and a slot freed here is
asked for at once; a slot freed at another router is seen within the window."""

from __future__ import annotations

import asyncio
import random

from router_svc.admission import Admission
from router_svc.queue_memo import QueueMemo
from services.errors import ResourceExhausted, TokenrelayError
from tests.router.admission_kit import FakeClock, PoolView, admission, req


def test_a_full_queue_refuses_its_class_until_a_slot_is_freed_here_or_the_window_ends() -> None:
    clock = FakeClock()
    memo = QueueMemo(0.25, clock)
    memo.full("t", "standard", 8, 900, asked_at=clock.t)
    assert memo.refusal("t", "standard", 8) == 900
    assert memo.refusal("t", "interactive", 8) is None     # another class may be granted before the queue counts
    assert memo.refusal("u", "standard", 8) is None        # another tenant: nothing known
    clock.t += 0.2
    assert memo.refusal("t", "standard", 8) == 700         # the retry-after counts down...
    memo.full("t", "standard", 8, 150, asked_at=clock.t)
    clock.t += 0.1
    assert memo.refusal("t", "standard", 8) == 100         # ...to the script's floor
    memo.freed("t")
    assert memo.refusal("t", "standard", 8) is None and len(memo) == 0
    memo.full("t", "standard", 8, 900, asked_at=clock.t)
    clock.t += 0.25
    assert memo.refusal("t", "standard", 8) is None and len(memo) == 0   # the window is over


def test_a_changed_limit_forgets_it_and_the_memo_is_off_and_bounded() -> None:
    clock = FakeClock()
    memo = QueueMemo(0.25, clock)
    memo.full("t", "standard", 8, 900, asked_at=clock.t)
    assert memo.refusal("t", "standard", 16) is None and len(memo) == 0   # the tenants file changed it
    off = QueueMemo(0.0, clock)
    off.full("t", "standard", 8, 900, asked_at=clock.t)
    assert off.refusal("t", "standard", 8) is None
    memo.full("t", "standard", 0, 900, asked_at=clock.t)                 # no queue at all: nothing kept
    assert len(memo) == 0
    small = QueueMemo(0.25, clock, max_tenants=3)
    for i in range(10):
        small.full(f"t{i}", "standard", 8, 900, asked_at=clock.t)
    assert len(small) == 3
    assert small.refusal("t9", "standard", 8) is not None and small.refusal("t0", "standard", 8) is None


# ------------------------------------------------------------------------------ with real Redis
def _prechecked(a: Admission, rid: str, mq: int) -> bool:
    try:
        a.precheck(req("t", rid, max_queued=mq))
    except TokenrelayError as exc:
        assert exc.reason == "TENANT_QUEUE_FULL" and exc.retry_after and exc.retry_after >= 0.1
        return True
    return False


async def _asked(a: Admission, rid: str, mq: int) -> tuple[bool, object]:
    """Ask Redis: (refused, what it admitted)."""
    try:
        return False, await a.admit(req("t", rid, max_queued=mq))
    except ResourceExhausted as exc:
        assert exc.reason == "TENANT_QUEUE_FULL"
        return True, None


async def test_a_request_queued_as_the_last_place_arms_it_and_a_grant_here_frees_it(redis_url) -> None:
    a = admission(redis_url, pool_capacity=1, queue_memo_ms=5000)
    try:
        running = await a.admit(req("t", "run", max_queued=2))
        assert running.grant is not None
        q1 = await a.admit(req("t", "q1", max_queued=2))
        assert q1.grant is None and not _prechecked(a, "x", 2)     # one place left: Redis decides
        q2 = await a.admit(req("t", "q2", max_queued=2))
        assert q2.grant is None
        assert _prechecked(a, "y", 2)                               # queued as the last place: known full
        assert (await _asked(a, "y", 2))[0]                         # and Redis says the same
        await running.grant.settle_tokens(10)                       # q1 is granted: a place is free
        await asyncio.wait_for(q1.next(), 5)
        assert q1.grant is not None
        assert not _prechecked(a, "z", 2)
        refused, z = await _asked(a, "z", 2)
        assert not refused and z.grant is None                      # queued in the freed place
        assert _prechecked(a, "w", 2)                               # ...its last one again
        for w in (q2, z):
            await w.abandon()
        await q1.grant.settle_tokens(0)
    finally:
        await a.close()


async def test_with_one_router_the_memo_refuses_only_what_redis_refuses(redis_url) -> None:
    # Random arrivals, completions and abandons against a small pool: every request the memo
    # refuses is then asked of Redis, which must refuse it too (a wrong refusal would be queued).
    a = admission(redis_url, pool_capacity=2, queue_memo_ms=10_000)
    view = PoolView(redis_url, a.settings.pool)
    rng = random.Random(7)
    held: list = []
    both = memo_only = asked = 0
    try:
        for i in range(300):
            op = rng.random()
            if op < 0.6:
                memo = _prechecked(a, f"r{i}", 3)
                refused, got = await _asked(a, f"r{i}", 3)
                asked += 1
                both += memo and refused
                memo_only += memo and not refused
                if got is not None:
                    held.append(got)
            elif held:
                one = held.pop(rng.randrange(len(held)))
                if one.grant is not None and op < 0.85:
                    await one.grant.settle_tokens(5)
                else:
                    await one.abandon()
                await asyncio.sleep(0.01)           # the grants it led to reach this router
        assert memo_only == 0, memo_only
        assert both >= 20, (both, asked)            # it does decide: 62 of 177 asks when written
        await view.check_invariants([c.name for c in a.classes])
    finally:
        for w in held:
            await (w.grant.settle_tokens(0) if w.grant is not None else w.abandon())
        await view.close()
        await a.close()


async def test_a_place_freed_at_another_router_is_asked_for_after_the_window(redis_url) -> None:
    here = admission(redis_url, pool_capacity=1, queue_memo_ms=300)
    there = Admission(here.settings)                              # another router, the same pool
    try:
        running = await here.admit(req("t", "run", max_queued=1))
        queued_there = await there.admit(req("t", "q", max_queued=1))
        assert queued_there.grant is None
        assert (await _asked(here, "seen", 1))[0]                 # refused by Redis: known full here
        await queued_there.abandon()                              # its place is freed over there
        assert _prechecked(here, "x", 1)      # not seen here yet: the memo's documented blind spot
        await asyncio.sleep(0.35)
        assert not _prechecked(here, "y", 1)                      # the window is over: Redis is asked
        refused, y = await _asked(here, "y", 1)
        assert not refused and y.grant is None
        await y.abandon()
        await running.grant.settle_tokens(0)
    finally:
        await here.close()
        await there.close()
