"""The request core with fake ports: ids claimed per tenant, deadlines, cancel, leases, deltas, bounds."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from router_svc.request import LocalRequestRegistry
from router_svc.types import Accepted, Delta, Done, GenerateInput, Sampling
from services.errors import Reason, TokenrelayError
from tests.router.core_fakes import OTHER, TENANT, FakeReplica, core, uid
from tests.waiting import poll


def _inp(**kw: Any) -> GenerateInput:
    return GenerateInput(Sampling(max_tokens=8), prompt="hi", **kw)


async def _drain(gen: Any) -> list[Any]:
    return [e async for e in gen]


async def test_registry_claims_are_per_tenant_and_atomic() -> None:
    reg = LocalRequestRegistry()
    assert await reg.claim("t", "x") and not await reg.claim("t", "x")
    assert await reg.claim("u", "x")               # another tenant's identical id is independent
    fired: list[str] = []
    reg.on_cancel("t", "x", lambda: fired.append("t"))
    assert not await reg.cancel("v", "x") and fired == []   # invisible to a third tenant
    assert await reg.cancel("t", "x") and fired == ["t"]
    await reg.release("t", "x")
    assert not await reg.cancel("t", "x") and await reg.claim("t", "x")


async def test_the_same_id_twice_at_once_one_runs_the_other_is_refused_at_once() -> None:
    c = core()
    c.tokenizer.gate = asyncio.Event()      # both are in flight before either tokenizes
    first = asyncio.ensure_future(_drain(c.router.generate(TENANT, _inp(request_id="same"))))
    await poll(lambda: c.tokenizer.calls == 1)
    with pytest.raises(TokenrelayError) as info:
        await _drain(c.router.generate(TENANT, _inp(request_id="same")))
    assert info.value.reason == Reason.DUPLICATE_REQUEST_ID
    c.tokenizer.gate.set()
    events = await asyncio.wait_for(first, 5)
    assert isinstance(events[-1], Done) and events[-1].finish_reason == "length"


async def test_another_tenants_identical_id_runs_independently() -> None:
    c = core()
    c.tokenizer.gate = asyncio.Event()
    a = asyncio.ensure_future(_drain(c.router.generate(TENANT, _inp(request_id="same"))))
    b = asyncio.ensure_future(_drain(c.router.generate(OTHER, _inp(request_id="same"))))
    await poll(lambda: c.tokenizer.calls == 2)
    c.tokenizer.gate.set()
    for events in await asyncio.wait_for(asyncio.gather(a, b), 5):
        assert isinstance(events[-1], Done)
    assert not await c.router.cancel(OTHER, "same")


async def test_an_engine_that_never_answers_ends_at_the_deadline_aborted_and_released() -> None:
    c = core(FakeReplica("e1", ["hang"]), progress_timeout=60)
    t0 = time.monotonic()
    with pytest.raises(TokenrelayError) as info:
        await _drain(c.router.generate(TENANT, _inp(request_id="r"), deadline=t0 + 0.3))
    assert info.value.reason == Reason.DEADLINE_EXCEEDED
    assert time.monotonic() - t0 < 2
    e1 = c.engines.replicas["e1"]
    assert len(e1.aborted) == 1 and e1.aborted == e1.submitted == e1.released
    assert c.admission.held == set() and c.router.in_flight == 0


async def test_the_server_default_deadline_applies_without_a_client_deadline() -> None:
    c = core(FakeReplica("e1", ["hang"]), progress_timeout=60, request_timeout=0.3)
    with pytest.raises(TokenrelayError) as info:
        await asyncio.wait_for(_drain(c.router.generate(TENANT, _inp())), 5)
    assert info.value.reason == Reason.DEADLINE_EXCEEDED and c.admission.held == set()


async def test_a_deadline_during_admission_leaves_no_lease() -> None:
    c = core()
    c.admission.gate = asyncio.Event()
    with pytest.raises(TokenrelayError) as info:
        await _drain(c.router.generate(TENANT, _inp(), deadline=time.monotonic() + 0.2))
    assert info.value.reason == Reason.DEADLINE_EXCEEDED and c.admission.held == set()


async def test_cancel_ends_a_hanging_request_with_done_cancelled_and_aborts_the_engine() -> None:
    c = core(FakeReplica("e1", ["hang"]), progress_timeout=60)
    run = asyncio.ensure_future(_drain(c.router.generate(TENANT, _inp(request_id="r"))))
    await poll(lambda: c.engines.replicas["e1"].submitted)
    assert not await c.router.cancel(OTHER, "r")      # another tenant cannot cancel it
    assert await c.router.cancel(TENANT, "r")
    events = await asyncio.wait_for(run, 5)
    assert isinstance(events[-1], Done) and events[-1].finish_reason == "cancelled"
    e1 = c.engines.replicas["e1"]
    assert len(e1.aborted) == 1 and e1.aborted == e1.submitted and c.admission.held == set()


async def test_cancel_during_admission_ends_without_engine_work() -> None:
    c = core()
    c.admission.gate = asyncio.Event()
    run = asyncio.ensure_future(_drain(c.router.generate(TENANT, _inp(request_id="r"))))
    await poll(lambda: c.router.live(TENANT.name, "r"))
    assert await c.router.cancel(TENANT, "r")
    c.admission.gate.set()
    events = await asyncio.wait_for(run, 5)
    assert events[-1].finish_reason == "cancelled" and c.engines.replicas["e1"].submitted == []
    assert c.admission.held == set()


async def test_every_output_ready_goes_out_in_one_delta() -> None:
    c = core(FakeReplica("e1", ["manual"]))
    gen = c.router.generate(TENANT, _inp(request_id="r", return_token_ids=True))
    assert isinstance(await anext(gen), Accepted)
    first = asyncio.ensure_future(anext(gen))
    source = await poll(lambda: c.engines.replicas["e1"].sources.get(uid(c, "r")))
    source.tokens(101)
    assert (await first).token_ids == [101]
    session = c.detok.sessions[uid(c, "r")]
    for i in range(5):           # five outputs ready before the loop runs again
        session.send([200 + i], final=False)
    delta = await anext(gen)
    assert isinstance(delta, Delta) and delta.token_ids == [] and delta.text == "".join(
        f"<{200 + i}>" for i in range(5))
    await gen.aclose()


async def test_min_delta_tokens_makes_fewer_fuller_deltas_and_the_final_never_waits() -> None:
    c = core(FakeReplica("e1", ["manual"]))
    gen = c.router.generate(TENANT, _inp(request_id="r", return_token_ids=True, min_delta_tokens=3))
    await anext(gen)
    task = asyncio.ensure_future(_drain(gen))
    source = await poll(lambda: c.engines.replicas["e1"].sources.get(uid(c, "r")))
    state = c.router.live(TENANT.name, "r")
    assert state is not None

    def consumed(n: int) -> bool:
        return len(state.generated) == n and source.queue.empty() and c.detok.sessions[uid(c, "r")].queue.empty()

    source.tokens(1)          # the first delta goes at once (TTFT)
    await poll(lambda: consumed(1))
    for t in (2, 3, 4, 5):
        source.tokens(t)
        await poll(lambda n=t: consumed(n))  # type: ignore[misc]
    source.tokens(6, finished=True)
    events = await asyncio.wait_for(task, 5)
    deltas = [e.token_ids for e in events if isinstance(e, Delta)]
    assert deltas == [[1], [2, 3, 4], [5, 6]]


@pytest.mark.parametrize(("field", "value", "reason"), [
    ("session_id", "s" * 129, Reason.INVALID_SESSION_ID),
    ("request_id", "r" * 129, Reason.INVALID_REQUEST_ID),
    ("model", "m" * 257, Reason.INVALID_MODEL),
    ("min_delta_tokens", 5000, Reason.INVALID_DELTA_OPTIONS),
    ("min_delta_interval_ms", 20_000, Reason.INVALID_DELTA_OPTIONS),
])
async def test_client_strings_and_options_are_bounded(field: str, value: object, reason: Reason) -> None:
    c = core()
    with pytest.raises(TokenrelayError) as info:
        await _drain(c.router.generate(TENANT, _inp(**{field: value})))
    assert info.value.reason == reason and info.value.code.name == "INVALID_ARGUMENT"
    assert c.tokenizer.calls == 0


async def test_messages_are_bounded_in_count_role_and_content() -> None:
    c = core()
    for messages in ([("user", "x")] * 1025, [("r" * 65, "x")], [("user", "x" * 1_000_001)]):
        with pytest.raises(TokenrelayError) as info:
            await _drain(c.router.generate(TENANT, GenerateInput(Sampling(max_tokens=4), messages=messages)))
        assert info.value.reason == Reason.TOO_MANY_MESSAGES


async def test_ttft_is_measured_from_the_calls_arrival() -> None:
    c = core()
    arrival = time.monotonic() - 0.5    # the call waited half a second before the handler ran
    events = await _drain(c.router.generate(TENANT, _inp(), t_arrival=arrival))
    assert events[-1].timings.ttft_seconds >= 0.5 and events[-1].timings.queue_seconds >= 0.5


async def test_done_goes_out_after_the_id_and_the_lease_are_released() -> None:
    # A client that has its `done` may reuse the id at once; Cancel then finds nothing.
    c = core()
    async for event in c.router.generate(TENANT, _inp(request_id="r")):
        if isinstance(event, Done):
            assert c.admission.held == set()
            assert not await c.router.cancel(TENANT, "r")


async def test_cancel_of_an_over_long_id_is_invalid_argument() -> None:
    with pytest.raises(TokenrelayError) as info:
        await core().router.cancel(TENANT, "x" * 129)
    assert info.value.reason == Reason.INVALID_REQUEST_ID
