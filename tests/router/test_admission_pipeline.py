"""The request core over the real admission queue (real redis-server; fake tokenizer and engines):
no lease or queue entry outlives its request, whichever way the request ends.

Reproduced first (found by bench/fairness_repro_leak.py under load): a grant that landed while its
queued request was being cancelled was never settled (`abandon()` saw the grant and did nothing; the
settle was never reached), and a client that went away right after its first `accepted` left a
granted lease behind; both were heartbeated for as long as the router ran.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from router_svc.admission import Admission
from router_svc.types import Accepted, GenerateInput, Sampling
from tests.router.admission_kit import PoolView, admission, req
from tests.router.core_fakes import TENANT, FakeReplica, core
from tests.waiting import poll


@contextlib.asynccontextmanager
async def _pool(redis_url: str, capacity: int) -> AsyncIterator[tuple[Admission, PoolView]]:
    """An admission client on a private pool of `capacity` slots, and a view of its keys."""
    a = admission(redis_url, pool_capacity=capacity)
    view = PoolView(redis_url, a.settings.pool)
    try:
        yield a, view
    finally:
        await a.close()
        await view.close()


async def _empty(view: PoolView) -> bool:
    return await view.leases() == 0 and await view.queued("standard") == 0


async def test_a_grant_that_lands_while_a_queued_request_is_abandoned_is_given_back(redis_url) -> None:
    async with _pool(redis_url, 1) as (a, view):
        holder = await a.admit(req("t", "holder"))
        queued = await a.admit(req("t", "queued"))
        assert queued.grant is None
        await holder.grant.settle_tokens(1)   # grants "queued": the notice sets its lease...
        assert queued.grant is not None
        await queued.abandon()                # ...while its request is being cancelled
        assert await _empty(view) and not a.book.leases


async def test_a_client_gone_right_after_accepted_leaves_no_lease(redis_url) -> None:
    async with _pool(redis_url, 4) as (a, view):
        c = core(FakeReplica("e1", ["hang"]), admission=a)
        stream = c.router.generate(TENANT, GenerateInput(Sampling(max_tokens=8), prompt="hi"))
        assert isinstance(await anext(stream), Accepted)
        assert await view.leases() == 1
        await stream.aclose()                 # the client goes away at its first message
        await poll(lambda: _empty(view), timeout=5, what="the lease given back")
        assert not a.book.leases


async def test_cancelling_queued_requests_while_grants_land_leaks_nothing(redis_url) -> None:
    async with _pool(redis_url, 2) as (a, view):
        c = core(FakeReplica("e1", ["hang"]), admission=a)
        for _ in range(5):
            streams = [c.router.generate(TENANT, GenerateInput(Sampling(max_tokens=8), prompt=f"p{i}"))
                       for i in range(8)]
            tasks = [asyncio.ensure_future(anext(s)) for s in streams]
            await asyncio.gather(*tasks)            # 2 running, 6 queued
            for s in streams:                       # every client goes away at once
                await s.aclose()
            await poll(lambda: _empty(view), timeout=5, what="every lease and queue entry given back")
        assert not a.book.leases and not a.book.waiting


async def test_an_early_admission_whose_request_stops_while_tokenizing_leaves_nothing(redis_url) -> None:
    # Admission alongside Tokenize (on by default, once the estimate is warm): whether the request
    # is cut off while its enqueue is in flight or after the grant landed, no lease or entry stays.
    async with _pool(redis_url, 4) as (a, view):
        c = core(admission=a)
        for i in range(16):
            assert [e async for e in c.router.generate(TENANT, GenerateInput(Sampling(max_tokens=2), prompt="hi",
                                                                                 request_id=f"w{i}"))]
        for delay in (0.0, 0.0005, 0.002, 0.05):
            c.tokenizer.gate = asyncio.Event()
            run = asyncio.ensure_future(anext(c.router.generate(TENANT, GenerateInput(
                Sampling(max_tokens=2), prompt="hi", request_id=f"cut{delay}"))))
            await asyncio.sleep(delay)
            if delay >= 0.05:
                assert await view.leases() == 1     # granted while its prompt was still being tokenized
            run.cancel()
            await asyncio.gather(run, return_exceptions=True)
            await poll(lambda: _empty(view), timeout=5, what="nothing held")
            assert not a.book.leases
        assert c.router.in_flight == 0


async def test_two_admissions_of_one_id_are_separate_entries(redis_url) -> None:
    # The router admits a request before its id claim is answered (early admission): a duplicate
    # id's admission, given back when its claim fails, must not end the first's lease.
    async with _pool(redis_url, 4) as (a, view):
        first = await a.admit(req("t", "same"))
        dup = await a.admit(req("t", "same"))
        assert first.grant is not None and dup.grant is not None and await view.leases() == 2
        await dup.grant.settle_tokens(0)
        assert await view.leases() == 1
        await first.grant.settle_tokens(10)
        assert await _empty(view) and not a.book.leases
