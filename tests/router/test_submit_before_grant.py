"""A request sent to its engine before admission answers (`--submit-before-grant`), over the real
admission queue (real redis-server; fake tokenizer and engines): sent before the grant only while
admission says a grant is all but sure; granted at once, it is served as usual from that engine
stage; queued, it is stopped at the engine and submitted again once granted; refused, it is stopped;
nothing leaks either way. Two admission clients on one pool stand for two routers.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from router_svc.admission import Admission
from router_svc.metrics import SUBMIT_BEFORE_GRANT
from router_svc.placement import LocalSessionAffinity
from router_svc.tenants import Tenant
from router_svc.types import Accepted, Delta, Done, GenerateInput, Sampling
from services.errors import Reason, TokenrelayError
from tests.router.admission_kit import PoolView, admission, req
from tests.router.core_fakes import TENANT, Core, FakeReplica, core
from tests.waiting import poll

LIMITED = Tenant(name="lim", api_key_sha256="2" * 64, max_in_flight=1, max_queued=0)


@contextlib.asynccontextmanager
async def _two_routers(redis_url: str, capacity: int) -> AsyncIterator[tuple[Admission, Admission, PoolView]]:
    """This router's admission client, another router's on the same pool, and a view of its keys."""
    a = admission(redis_url, pool_capacity=capacity)
    b = Admission(a.settings)
    view = PoolView(redis_url, a.settings.pool)
    try:
        yield a, b, view
    finally:
        await a.close()
        await b.close()
        await view.close()


def _order(c: Core, a: Admission) -> list[tuple[str, str]]:
    """What happened, in order: ("submit", upstream id) at the engine, ("answer", outcome) at admission."""
    events: list[tuple[str, str]] = []
    submit, outcome = c.engines.submit, a.outcome

    def submitted(address: str, request_id: str, *args: Any, **kw: Any) -> Any:
        events.append(("submit", request_id))
        return submit(address, request_id, *args, **kw)

    def answered(tenant: str, cls: str, what: str) -> None:
        events.append(("answer", what))
        outcome(tenant, cls, what)
    c.engines.submit = submitted  # type: ignore[method-assign]
    a.outcome = answered  # type: ignore[method-assign]
    return events


async def _warm(c: Core) -> None:
    """16 prompts: the prompt estimate is warm (admission then starts alongside tokenization)."""
    for i in range(16):
        assert [e async for e in c.router.generate(TENANT, GenerateInput(Sampling(max_tokens=2), prompt=f"w{i}"))]


def _count(outcome: str) -> float:
    return SUBMIT_BEFORE_GRANT.labels(outcome)._value.get()


async def _empty(view: PoolView) -> bool:
    return await view.leases() == 0 and await view.queued("standard") == 0


async def test_a_likely_grant_is_submitted_before_the_answer_and_served_from_that_stage(redis_url) -> None:
    async with _two_routers(redis_url, 4) as (a, _, view):
        c = core(admission=a)
        await _warm(c)
        events = _order(c, a)
        used = _count("used")
        out = [e async for e in c.router.generate(TENANT, GenerateInput(Sampling(max_tokens=3), prompt="hello"))]
        assert events[0][0] == "submit" and events[1] == ("answer", "granted")
        assert isinstance(out[0], Accepted) and isinstance(out[1], Delta) and isinstance(out[-1], Done)
        assert out[-1].usage.completion_tokens == 3 and _count("used") == used + 1
        assert len(c.engines.replicas["e1"].submitted) == 17 and not c.engines.replicas["e1"].aborted
        await poll(lambda: _empty(view), timeout=5, what="the lease given back")
        assert c.router._early_engines == 0


async def test_off_the_engine_hears_of_a_request_only_after_its_grant(redis_url) -> None:
    async with _two_routers(redis_url, 4) as (a, _, _view):
        c = core(admission=a, submit_before_grant=0)
        await _warm(c)
        events = _order(c, a)
        assert [e async for e in c.router.generate(TENANT, GenerateInput(Sampling(max_tokens=3), prompt="hello"))]
        assert events[0] == ("answer", "granted") and events[1][0] == "submit"


async def test_queued_it_is_stopped_at_the_engine_and_submitted_again_once_granted(redis_url) -> None:
    async with _two_routers(redis_url, 2) as (a, b, view):
        c = core(FakeReplica("e1", ["ok"] * 16 + ["hang", "ok"]), admission=a)   # the early submit hangs
        await _warm(c)
        queued = _count("queued")
        held = [await b.admit(req("u", f"other{i}")) for i in range(2)]   # another router fills the pool
        assert all(h.grant is not None for h in held)
        stream = c.router.generate(TENANT, GenerateInput(Sampling(max_tokens=3), prompt="hello"))
        first = await anext(stream)
        assert isinstance(first, Accepted) and first.queue_position > 0
        replica = c.engines.replicas["e1"]
        early = replica.submitted[-1]
        assert early in replica.aborted and early in replica.released and _count("queued") == queued + 1
        for h in held:
            assert h.grant is not None
            await h.grant.settle_tokens(1)
        rest = [e async for e in stream]
        assert isinstance(rest[0], Delta) and isinstance(rest[-1], Done) and rest[-1].usage.completion_tokens == 3
        assert replica.submitted[-1] != early and replica.submitted[-1] not in replica.aborted
        assert replica.in_flight == 0
        await poll(lambda: _empty(view), timeout=5, what="every lease and entry given back")
        assert c.router._early_engines == 0


@contextlib.asynccontextmanager
async def _at_its_limit(redis_url: str) -> AsyncIterator[tuple[Core, PoolView]]:
    """A router, warm, whose tenant LIMITED has its one slot taken at another router."""
    async with _two_routers(redis_url, 8) as (a, b, view):
        c = core(FakeReplica("e1", ["ok"] * 16 + ["hang"]), admission=a)
        await _warm(c)
        held = await b.admit(req("lim", "theirs", max_in_flight=1, max_queued=0))
        assert held.grant is not None
        yield c, view
        await held.grant.settle_tokens(1)
        await poll(lambda: _empty(view), timeout=5, what="every lease given back")
        assert c.router._early_engines == 0


async def _refused(c: Core) -> str:
    try:
        [e async for e in c.router.generate(LIMITED, GenerateInput(Sampling(max_tokens=3), prompt="hello"))]
    except TokenrelayError as exc:
        return exc.reason
    raise AssertionError("not refused")


async def test_refused_it_is_stopped_at_the_engine_and_the_refusal_is_the_answer(redis_url) -> None:
    async with _at_its_limit(redis_url) as (c, _):
        stopped = _count("stopped")
        replica = c.engines.replicas["e1"]
        before = len(replica.submitted)
        assert await _refused(c) == Reason.TENANT_CONCURRENCY_LIMIT
        assert len(replica.submitted) == before + 1      # it was sent before the answer...
        assert replica.submitted[-1] in replica.aborted  # ...and stopped there
        assert replica.in_flight == 0 and _count("stopped") == stopped + 1


async def test_not_sent_early_while_admission_has_recently_not_granted_at_once(redis_url) -> None:
    # After a queued or refused answer, two calm seconds must pass: a tenant at its limit costs its
    # engines one early submit, not one per request.
    async with _at_its_limit(redis_url) as (c, _):
        for _ in range(3):
            assert await _refused(c) == Reason.TENANT_CONCURRENCY_LIMIT
        assert len(c.engines.replicas["e1"].aborted) == 1


class _SlowLookup(LocalSessionAffinity):
    """Session affinity whose lookup (a Redis round trip across routers) answers only when let."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()

    async def get(self, tenant: str, session_id: str) -> str:
        await self.gate.wait()
        return await super().get(tenant, session_id)


async def test_a_session_this_router_knows_is_placed_early_without_waiting_for_its_lookup(redis_url) -> None:
    # The session's replica is looked up when the request arrives and answered with admission's
    # replies: an early start waiting for it would gain nothing. Known here (this process placed the
    # session's last turn), it is placed there at once; sent after its grant, it waits as before.
    for early in (4, 0):
        async with _two_routers(redis_url, 8) as (a, _, _view):
            c = core(FakeReplica("e1"), FakeReplica("e2"), admission=a, submit_before_grant=early)
            await _warm(c)
            lookup = _SlowLookup()
            c.router.ports.affinity = c.router.stage.affinity = lookup
            await lookup.set("t", "s1", "e2")
            before = {r.address: len(r.submitted) for r in c.engines.replicas.values()}
            run = asyncio.ensure_future(_drain(c.router.generate(
                TENANT, GenerateInput(Sampling(max_tokens=3), prompt="hello", session_id="s1"))))
            await asyncio.sleep(0.3)
            assert run.done() == bool(early)
            lookup.gate.set()
            out = await run
            assert isinstance(out[-1], Done)
            after = {r.address: len(r.submitted) for r in c.engines.replicas.values()}
            assert after == {"e1": before["e1"], "e2": before["e2"] + 1}    # on the session's replica


async def _drain(stream: AsyncIterator[object]) -> list[object]:
    return [e async for e in stream]
