"""Admission alongside Tokenize (`--admit-while-tokenizing`, on by default): once the router has
seen enough prompts of a kind to estimate tokens per character, a text or chat request goes to
admission while its prompt is tokenized, so the two round trips overlap. Nothing it was granted is
kept when the request does not go on; a token-budget refusal on an over-estimate is asked again
with the real count. Admission does not wait for the id claim either, and a refusal the token count
cannot change (a full queue) is the answer at once."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from router_svc.ports import AdmitRequest
from router_svc.request import LocalRequestRegistry, PromptEstimate
from router_svc.types import Done, GenerateInput, Sampling
from services.errors import Reason, TokenrelayError
from tests.router.core_fakes import TENANT, FakeAdmission, FakeAdmitting, FakeReplica, core
from tests.waiting import poll

MAX_TOKENS = 8


def _inp(prompt: str = "hello world", **kw: Any) -> GenerateInput:
    return GenerateInput(Sampling(max_tokens=MAX_TOKENS), prompt=prompt, **kw)


async def _drain(gen: Any) -> list[Any]:
    return [e async for e in gen]


async def _warm(c: Any, n: int = 16) -> None:
    for i in range(n):
        events = await _drain(c.router.generate(TENANT, _inp(request_id=f"w{i}")))
        assert isinstance(events[-1], Done)


def test_the_estimate_learns_tokens_per_character_per_kind_of_input() -> None:
    est = PromptEstimate(warm=3, alpha=0.5)
    text, chat = GenerateInput(Sampling(8), prompt="x" * 100), GenerateInput(Sampling(8), messages=[("user", "x" * 96)])
    ids = GenerateInput(Sampling(8), token_ids=[1, 2, 3])
    for _ in range(2):
        est.observe(text, 25)
    assert est.tokens(text) is None                     # not warm yet
    est.observe(text, 25)
    assert est.tokens(text) == 25 and est.tokens(GenerateInput(Sampling(8), prompt="y" * 400)) == 100
    assert est.tokens(chat) is None and est.tokens(ids) is None     # chat is its own kind; ids need none
    est.observe(text, 75)                               # an exponential average, not the last value
    assert est.tokens(text) == 50
    for _ in range(3):
        est.observe(chat, 50)
    assert est.tokens(chat) == 50


async def test_admission_runs_while_the_prompt_is_tokenized() -> None:
    c = core()
    await _warm(c)
    c.tokenizer.gate = asyncio.Event()                  # the next Tokenize waits
    before = len(c.admission.requests)
    run = asyncio.ensure_future(_drain(c.router.generate(TENANT, _inp(request_id="r"))))
    await poll(lambda: len(c.admission.requests) > before, what="admission before the prompt is tokenized")
    assert not run.done() and c.tokenizer.calls == 17
    # The fake tokenizer makes one token per character: the estimate is exact here.
    assert c.admission.requests[-1].cost == len("hello world") + MAX_TOKENS
    c.tokenizer.gate.set()
    events = await asyncio.wait_for(run, 5)
    assert isinstance(events[-1], Done) and c.admission.held == set()


async def test_off_admission_waits_for_the_prompt() -> None:
    c = core(admit_while_tokenizing=False)
    await _warm(c)
    c.tokenizer.gate = asyncio.Event()
    before = len(c.admission.requests)
    run = asyncio.ensure_future(_drain(c.router.generate(TENANT, _inp(request_id="r"))))
    await poll(lambda: c.tokenizer.calls == 17)
    await asyncio.sleep(0.05)
    assert len(c.admission.requests) == before
    c.tokenizer.gate.set()
    assert isinstance((await asyncio.wait_for(run, 5))[-1], Done)


async def test_a_tokenize_that_fails_gives_the_early_grant_back() -> None:
    c = core()
    await _warm(c)
    gate = asyncio.Event()

    async def failing(**_: Any) -> list[int]:
        await gate.wait()
        raise Reason.UPSTREAM_UNAVAILABLE.error("tokenizer gone")
    c.tokenizer.tokenize = failing  # type: ignore[method-assign]
    run = asyncio.ensure_future(_drain(c.router.generate(TENANT, _inp(request_id="r"))))
    await poll(lambda: (TENANT.name, "r") in c.admission.held, what="the early grant")
    gate.set()
    with pytest.raises(TokenrelayError) as info:
        await asyncio.wait_for(run, 5)
    assert info.value.reason == Reason.UPSTREAM_UNAVAILABLE
    assert c.admission.held == set() and c.router.in_flight == 0


async def test_a_client_gone_while_tokenizing_gives_the_early_grant_back() -> None:
    c = core()
    await _warm(c)
    c.tokenizer.gate = asyncio.Event()
    run = asyncio.ensure_future(_drain(c.router.generate(TENANT, _inp(request_id="r"))))
    await poll(lambda: (TENANT.name, "r") in c.admission.held, what="the early grant")
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    await poll(lambda: c.admission.held == set(), what="the grant given back")
    assert c.router.in_flight == 0


async def test_a_client_gone_while_both_are_on_their_way_stops_the_tokenize_call() -> None:
    c = core()
    await _warm(c)
    c.tokenizer.gate, c.admission.gate = asyncio.Event(), asyncio.Event()
    before = len(c.admission.requests)
    run = asyncio.ensure_future(_drain(c.router.generate(TENANT, _inp(request_id="r"))))
    await poll(lambda: len(c.admission.requests) > before, what="the early admission on its way")
    pending = [t for t in asyncio.all_tasks() if getattr(t.get_coro(), "__qualname__", "") == "Router._tokenize"]
    assert len(pending) == 1                            # the Tokenize call, still waiting
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    assert pending[0].cancelled()                       # stopped with its request, not left running
    c.admission.gate.set()
    await poll(lambda: c.admission.held == set(), what="nothing held")
    assert c.router.in_flight == 0


async def test_a_too_long_prompt_found_after_an_early_grant_gives_it_back() -> None:
    c = core()
    await _warm(c)
    with pytest.raises(TokenrelayError) as info:        # the context (4096) is checked on the real ids
        await _drain(c.router.generate(TENANT, _inp("x" * 5000, request_id="long")))
    assert info.value.reason in (Reason.PROMPT_TOO_LONG, Reason.CONTEXT_LENGTH_EXCEEDED)
    assert len(c.admission.requests) == 17              # it was admitted early...
    assert c.admission.held == set()                    # ...and given back


class _Budget(FakeAdmission):
    """Refuses a request whose cost is above `limit` (a tenant's whole token budget)."""

    limit = 1_000_000

    async def admit(self, request: AdmitRequest) -> FakeAdmitting:
        if request.cost > self.limit:
            self.requests.append(request)
            raise Reason.TOKEN_BUDGET_TOO_SMALL.error("over the budget")
        return await super().admit(request)


async def test_a_budget_refusal_on_an_over_estimate_is_asked_again_with_the_real_count() -> None:
    adm = _Budget()
    c = core(admission=adm)
    await _warm(c)
    real = c.tokenizer.tokenize

    async def compact(**kw: Any) -> list[int]:         # this prompt tokenizes to 10x fewer ids
        ids = await real(**kw)
        return ids[: max(1, len(ids) // 10)]
    c.tokenizer.tokenize = compact  # type: ignore[method-assign]
    adm.limit = 200 + MAX_TOKENS                        # the estimate (1,000) is over it; the real 100 is not
    events = await _drain(c.router.generate(TENANT, _inp("y" * 1000, request_id="big")))
    assert isinstance(events[-1], Done)
    assert [r.cost for r in adm.requests[-2:]] == [1000 + MAX_TOKENS, 100 + MAX_TOKENS]
    adm.limit = 50                                      # over the budget for real: refused, once asked again
    with pytest.raises(TokenrelayError) as info:
        await _drain(c.router.generate(TENANT, _inp("y" * 1000, request_id="big2")))
    assert info.value.reason == Reason.TOKEN_BUDGET_TOO_SMALL and adm.held == set()


async def test_a_full_queue_refusal_is_the_answer_without_waiting_for_tokenize() -> None:
    # The refusal does not depend on the token count: the client has it while the prompt is still
    # being tokenized, and the Tokenize call is stopped.
    c = core()
    await _warm(c)
    c.tokenizer.gate = asyncio.Event()                  # Tokenize never answers in this test
    c.admission.refuse = Reason.TENANT_QUEUE_FULL.error("queue full")
    with pytest.raises(TokenrelayError) as info:
        await asyncio.wait_for(_drain(c.router.generate(TENANT, _inp(request_id="r"))), 2)
    assert info.value.reason == Reason.TENANT_QUEUE_FULL
    assert c.router.in_flight == 0 and c.admission.held == set()
    c.admission.refuse = None
    c.tokenizer.gate.set()
    assert isinstance((await _drain(c.router.generate(TENANT, _inp(request_id="r"))))[-1], Done)


async def test_a_budget_refusal_on_the_estimate_still_waits_for_the_real_count() -> None:
    # TOKEN_RATE_LIMITED may be an over-estimate's: it is not final before the prompt is tokenized.
    c = core()
    await _warm(c)
    c.tokenizer.gate = asyncio.Event()
    c.admission.refuse = Reason.TOKEN_RATE_LIMITED.error("over the rate")
    run = asyncio.ensure_future(_drain(c.router.generate(TENANT, _inp(request_id="r"))))
    await poll(lambda: len(c.admission.requests) == 17, what="the early admission")
    await asyncio.sleep(0.05)
    assert not run.done()
    c.tokenizer.gate.set()
    with pytest.raises(TokenrelayError) as info:
        await asyncio.wait_for(run, 2)
    assert info.value.reason == Reason.TOKEN_RATE_LIMITED


class _SlowClaims(LocalRequestRegistry):
    """A registry whose claim is a round trip (as Redis's is with several routers)."""

    remote = True

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.gate.set()

    async def claim(self, tenant: str, request_id: str) -> bool:
        ok = self.take(tenant, request_id)
        await self.gate.wait()
        return ok


async def test_admission_does_not_wait_for_the_id_claim_and_a_duplicate_gives_its_own_back() -> None:
    c = core()
    registry = _SlowClaims()
    c.router.ports.registry = registry
    await _warm(c)
    registry.gate.clear()
    before = len(c.admission.requests)
    run = asyncio.ensure_future(_drain(c.router.generate(TENANT, _inp(request_id="r"))))
    await poll(lambda: len(c.admission.requests) > before, what="admission before the claim is answered")
    assert not run.done()
    registry.gate.set()
    assert isinstance((await asyncio.wait_for(run, 5))[-1], Done)
    # A duplicate id: its claim fails after its early admission went out; that admission is given back.
    registry.take(TENANT.name, "dup")                   # "dup" is in flight (elsewhere)
    registry.gate.clear()
    run = asyncio.ensure_future(_drain(c.router.generate(TENANT, _inp(request_id="dup"))))
    await poll(lambda: (TENANT.name, "dup") in c.admission.held, what="the duplicate's early grant")
    registry.gate.set()
    with pytest.raises(TokenrelayError) as info:
        await asyncio.wait_for(run, 5)
    assert info.value.reason == Reason.DUPLICATE_REQUEST_ID
    assert c.admission.held == set() and c.router.in_flight == 0


async def test_the_early_enqueue_the_id_claim_and_the_session_lookup_start_before_the_prompt_is_encoded() -> None:
    """The Redis calls are started (each writes in its first step, `Batcher` / `Pipeliner` while
    idle; the session lookup in the loop turn the tokenization waits before it encodes) before the
    tokenization's first step, which may encode on the loop: Redis answers them while the CPU encodes,
    and placement finds the session's replica in at the grant. (It replaces two loop turns LocalTokenize
    used to wait before encoding; the lookup went out after the encode until 2026-12-07.)"""
    c = core()
    registry = _SlowClaims()
    c.router.ports.registry = registry
    await _warm(c)
    order: list[str] = []
    real_admit, real_claim, real_tokenize = c.admission.admit, registry.claim, c.tokenizer.tokenize

    async def admit(request: Any) -> Any:
        order.append("enqueue")
        return await real_admit(request)

    async def claim(tenant: str, request_id: str) -> bool:
        order.append("claim")
        return await real_claim(tenant, request_id)

    async def tokenize(**kw: Any) -> list[int]:
        order.append("encode")
        return await real_tokenize(**kw)
    real_get = c.router.ports.affinity.get

    async def lookup(tenant: str, session_id: str) -> str:
        order.append("lookup")
        return await real_get(tenant, session_id)
    c.admission.admit, registry.claim, c.tokenizer.tokenize = admit, claim, tokenize   # type: ignore[method-assign]
    c.router.ports.affinity.get = lookup  # type: ignore[method-assign]
    events = await _drain(c.router.generate(TENANT, _inp(request_id="ordered", session_id="s")))
    assert isinstance(events[-1], Done)
    assert order == ["enqueue", "claim", "lookup", "encode"]


async def test_a_sessions_replica_is_asked_for_while_the_prompt_is_tokenized() -> None:
    """With several routers the session lookup is a Redis round trip: it runs alongside Tokenize and
    admission, and placement reads its answer instead of asking after them."""
    c = core(FakeReplica("e1"), FakeReplica("e2"))
    asked: list[str] = []
    affinity = c.router.ports.affinity
    real_get = affinity.get

    async def get(tenant: str, session_id: str) -> str:
        asked.append(session_id)
        return await real_get(tenant, session_id)
    affinity.get = get   # type: ignore[method-assign]
    first = await _drain(c.router.generate(TENANT, _inp(request_id="t1", session_id="s1")))
    assert isinstance(first[-1], Done) and asked == ["s1"]
    (home,) = [r for r in c.engines.replicas.values() if r.submitted]
    home.in_flight += 3      # least-loaded alone would now pick the other replica
    c.tokenizer.gate = asyncio.Event()                  # the next Tokenize waits
    run = asyncio.ensure_future(_drain(c.router.generate(TENANT, _inp(request_id="t2", session_id="s1"))))
    await poll(lambda: len(asked) == 2, what="the session lookup before the prompt is tokenized")
    assert not run.done()
    c.tokenizer.gate.set()
    events = await asyncio.wait_for(run, 5)
    assert isinstance(events[-1], Done) and len(asked) == 2   # placement asked no second time
    assert len(home.submitted) == 2                            # and the session stuck to its replica


async def test_a_full_queue_is_the_answer_before_the_id_claim_lands_and_the_claim_is_given_back() -> None:
    c = core()
    await _warm(c)
    slow = _SlowClaims()
    c.router.ports.registry = slow
    slow.gate.clear()
    c.admission.refuse = Reason.TENANT_QUEUE_FULL.error("queue full", retry_after=0.1)
    with pytest.raises(TokenrelayError) as e:
        await asyncio.wait_for(_drain(c.router.generate(TENANT, _inp(request_id="q"))), 5)
    assert e.value.reason == "TENANT_QUEUE_FULL" and not slow.gate.is_set()   # answered, the claim in flight
    assert slow.pairs() == [(TENANT.name, "q")]
    slow.gate.set()                                      # the claim lands: given back
    await poll(lambda: len(slow) == 0, timeout=5, what="the late claim to be released")
    c.admission.refuse = None
    events = await _drain(c.router.generate(TENANT, _inp(request_id="q")))    # the id is free again
    assert isinstance(events[-1], Done) and len(slow) == 0


async def test_a_cancel_while_the_id_claim_is_answered_ends_the_request_without_engine_work() -> None:
    # The id is held from the claim's first step; the request registered its cancel callback only
    # once the claim came back, so a Cancel in between answered `cancelled` and the request ran on.
    c = core()
    registry = _SlowClaims()
    c.router.ports.registry = registry
    registry.gate.clear()
    run = asyncio.ensure_future(_drain(c.router.generate(TENANT, _inp(request_id="r"))))
    await poll(lambda: registry.holds(TENANT.name, "r"), what="the claim on its way")
    assert await c.router.cancel(TENANT, "r")
    registry.gate.set()
    events = await asyncio.wait_for(run, 5)
    assert isinstance(events[-1], Done) and events[-1].finish_reason == "cancelled"
    assert c.engines.replicas["e1"].submitted == [] and c.admission.held == set()
