"""Unit tests of the simulated engine: batching, admission, prefix caching, stops, aborts, speed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from engine_svc.backends.base import FinishReason
from engine_svc.backends.sim import SimBackend, SimConfig
from engine_svc.engine import Engine
from services.errors import InvalidArgument
from tests.engine.engine_testkit import Collector, fast_sim, poll, req, run_backend


@pytest.fixture
async def make_sim() -> AsyncIterator:
    started: list[SimBackend] = []

    async def make(config: SimConfig) -> SimBackend:
        backend = SimBackend(config)
        await backend.start()
        started.append(backend)
        return backend

    yield make
    for backend in started:
        await backend.close()



async def test_output_is_deterministic_in_seed_prompt_and_position(make_sim) -> None:
    a, b = await make_sim(fast_sim()), await make_sim(fast_sim())
    reqs = [req("greedy", [5, 6, 7], 12), req("seeded", [5, 6, 7], 12, temperature=0.8, seed=42),
            req("other-seed", [5, 6, 7], 12, temperature=0.8, seed=43), req("other-prompt", [5, 6, 8], 12)]
    ra, rb = await run_backend(a, reqs), await run_backend(b, reqs)
    for r in reqs:
        assert ra.tokens(r.request_id) == rb.tokens(r.request_id)
        assert len(ra.tokens(r.request_id)) == 12
        assert all(0 <= t < 1000 for t in ra.tokens(r.request_id))
    assert ra.tokens("seeded") != ra.tokens("other-seed")
    assert ra.tokens("greedy") != ra.tokens("other-prompt")
    # Greedy ignores the seed.
    rc = await run_backend(a, [req("greedy-seed", [5, 6, 7], 12, seed=7)])
    assert rc.tokens("greedy-seed") == ra.tokens("greedy")
    # Longer runs extend the same stream: position-wise determinism.
    rd = await run_backend(a, [req("longer", [5, 6, 7], 20)])
    assert rd.tokens("longer")[:12] == ra.tokens("greedy")


async def test_resubmitting_prompt_plus_output_continues_the_same_stream(make_sim) -> None:
    # What token migration relies on: like a greedy model, the next token depends on the context.
    backend = await make_sim(fast_sim())
    for kw in ({}, {"temperature": 0.9, "seed": 5}):
        full = await run_backend(backend, [req("full", [8, 9, 10], 30, **kw)])
        head = full.tokens("full")[:11]
        rest = await run_backend(backend, [req("rest", [8, 9, 10, *head], 19, **kw)])
        assert rest.tokens("rest") == full.tokens("full")[11:]


async def test_batch_is_capped_and_admission_is_fifo(make_sim) -> None:
    backend = await make_sim(fast_sim(max_batch_size=2))
    sink = Collector()
    seen_active: list[int] = []
    first_token_order: list[str] = []

    def record(event) -> None:
        seen_active.append(backend.load().active)
        if event.request_id not in sink.events:
            first_token_order.append(event.request_id)
        sink(event)

    ids = [f"r{i}" for i in range(5)]
    for rid in ids:
        backend.submit(req(rid, [1, 2, 3], 4), record)
    assert backend.load().queued == 5
    await sink.wait(*ids)
    assert max(seen_active) == 2
    assert first_token_order == ids
    assert all(sink.count(rid) == 4 and sink.last(rid).finish_reason is FinishReason.LENGTH for rid in ids)
    load = backend.load()
    assert (load.active, load.queued, load.kv_blocks_used) == (0, 0, 0)
    assert load.generated_tokens_total == 20 and load.prompt_tokens_total == 15


async def test_kv_capacity_gates_admission(make_sim) -> None:
    # 8 blocks of 4 tokens; each request reserves prompt + max_tokens = 24 tokens = 6 blocks.
    backend = await make_sim(fast_sim(num_blocks=8, tokens_per_block=4, max_batch_size=8,
                                      decode_step_time=0.002))
    sink = Collector()
    backend.submit(req("a", list(range(4)), 20), sink)
    backend.submit(req("b", list(range(100, 104)), 20), sink)
    await poll(lambda: sink.count("a") >= 1, what="a running")
    load = backend.load()
    assert load.active == 1 and load.queued == 1 and load.kv_blocks_used == 6
    await sink.wait("a")
    await poll(lambda: sink.count("b") >= 1, what="b admitted after a released its blocks")
    await sink.wait("b")
    with pytest.raises(InvalidArgument) as info:
        backend.submit(req("too-big", list(range(30)), 10), sink)
    assert info.value.reason == "CONTEXT_LENGTH_EXCEEDED"


async def test_prefix_cache_hits_are_reported_per_request_and_in_load(make_sim) -> None:
    backend = await make_sim(fast_sim(tokens_per_block=4))
    prompt = list(range(1, 19))  # 4 full blocks + 2 tokens
    first = await run_backend(backend, [req("first", prompt, 3)])
    assert first.events["first"][0].cached_tokens == 0
    second = await run_backend(backend, [req("second", [*prompt, 50], 3)])
    assert second.events["second"][0].cached_tokens == 16
    salted = await run_backend(backend, [req("salted", prompt, 3, cache_salt="tenant-b")])
    assert salted.events["salted"][0].cached_tokens == 0
    load = backend.load()
    assert load.cached_tokens_total == 16
    assert load.prompt_tokens_total == 18 + 19 + 18


async def test_stop_on_eos_and_stop_ids_unless_ignored(make_sim) -> None:
    backend = await make_sim(fast_sim(eos_probability=1.0))
    out = await run_backend(backend, [req("eos", [1, 2], 10, eos_token_ids=[999]),
                                  req("ignored", [1, 2], 10, eos_token_ids=[999], ignore_eos=True),
                                  req("no-eos-ids", [1, 2], 10)])
    assert out.tokens("eos") == [999] and out.last("eos").finish_reason is FinishReason.STOP
    assert out.tokens("ignored") == [999] * 10 and out.last("ignored").finish_reason is FinishReason.LENGTH
    assert out.last("no-eos-ids").finish_reason is FinishReason.LENGTH

    plain = await make_sim(fast_sim())
    ref = await run_backend(plain, [req("ref", [3, 4, 5], 10)])
    third = ref.tokens("ref")[2]
    stop_at = ref.tokens("ref").index(third) + 1
    out = await run_backend(plain, [req("stopped", [3, 4, 5], 10, stop_token_ids=[third], ignore_eos=True)])
    assert out.tokens("stopped") == ref.tokens("ref")[:stop_at]
    assert out.last("stopped").finish_reason is FinishReason.STOP


async def test_some_requests_end_early_with_partial_eos_probability(make_sim) -> None:
    # P(no EOS in 30 tokens) = 0.95**30 ≈ 0.21, and outputs are deterministic per prompt.
    backend = await make_sim(fast_sim(eos_probability=0.05, max_batch_size=64))
    out = await run_backend(backend, [req(f"r{i}", [i], 30, eos_token_ids=[7]) for i in range(40)])
    reasons = [out.last(f"r{i}").finish_reason for i in range(40)]
    assert FinishReason.STOP in reasons and FinishReason.LENGTH in reasons


async def test_abort_waiting_and_running_frees_everything(make_sim) -> None:
    backend = await make_sim(fast_sim(max_batch_size=1, decode_step_time=0.001))
    sink = Collector()
    backend.submit(req("running", [1, 2, 3], 400), sink)
    backend.submit(req("waiting", [4, 5, 6], 400), sink)
    await poll(lambda: sink.count("running") >= 2, what="tokens")
    assert backend.abort("waiting") and backend.abort("running")
    assert not backend.abort("running") and not backend.abort("unknown")
    for rid in ("running", "waiting"):
        assert sink.last(rid).finished and sink.last(rid).finish_reason is FinishReason.CANCELLED
    load = backend.load()
    assert (load.active, load.queued, load.kv_blocks_used) == (0, 0, 0)
    count = sink.count("running")
    await asyncio.sleep(0.01)  # several step periods: nothing more may arrive for an aborted request
    assert sink.count("running") == count


async def test_generate_iterator_aborts_when_the_consumer_leaves(make_sim) -> None:
    backend = await make_sim(fast_sim(decode_step_time=0.001))
    got = []
    async for event in backend.generate(req("it", [1, 2], 300)):
        got.append(event)
        if len(got) == 3:
            break
    await poll(lambda: backend.load().active == 0, what="abort after break")
    full = [e async for e in backend.generate(req("full", [1, 2], 5))]
    assert [t for e in full for t in e.token_ids] == [t for e in got for t in e.token_ids][:3] + \
        [t for e in full for t in e.token_ids][3:]
    assert full[-1].finished and full[-1].finish_reason is FinishReason.LENGTH


async def test_cost_model_charges_prefill_and_decode_time(make_sim) -> None:
    backend = await make_sim(fast_sim(prefill_time_per_token=0.001, decode_step_time=0.01,
                                      decode_time_per_seq=0.0, tokens_per_block=16))
    sink = Collector()
    t0 = time.perf_counter()
    backend.submit(req("timed", list(range(50)), 5), sink)
    await poll(lambda: sink.count("timed") >= 1, what="first token")
    ttft = time.perf_counter() - t0
    await sink.wait("timed")
    total = time.perf_counter() - t0
    assert ttft >= 0.05 + 0.01 * 0.9          # 50 uncached prompt tokens + one decode step
    assert total >= 0.05 + 5 * 0.01 * 0.9     # then four more steps
    assert total < 2.0


async def test_engine_facade_rejects_duplicates_and_overload(make_sim) -> None:
    backend = SimBackend(fast_sim(max_batch_size=2, decode_step_time=0.001))
    engine = Engine(backend, max_queued=1)
    await engine.start()
    try:
        sink = Collector()
        for rid in ("a", "b", "c"):
            engine.submit(req(rid, [1], 500), sink)
        with pytest.raises(InvalidArgument) as dup:
            engine.submit(req("a", [1], 5), sink)
        assert dup.value.reason == "DUPLICATE_REQUEST_ID"
        with pytest.raises(Exception) as over:
            engine.submit(req("d", [1], 5), sink)
        assert getattr(over.value, "reason", "") == "OVERLOADED"
        assert engine.abort(["a", "zzz"]) == 1
        engine.submit(req("d", [1], 5), sink)  # room again (it waits for a batch slot)
        assert engine.abort(["b", "c"]) == 2
        await sink.wait("d")
        assert sink.last("d").finish_reason is FinishReason.LENGTH
        assert engine.live == 0
    finally:
        await engine.close()


async def test_sim_sustains_tens_of_thousands_of_tokens_per_second(make_sim) -> None:
    backend = await make_sim(fast_sim(max_batch_size=256, num_blocks=20_000, tokens_per_block=32,
                                      vocab_size=128_000, max_context=4096))
    requests = [req(f"r{i}", [i, i + 1, i + 2] * 40, 128) for i in range(256)]
    t0 = time.perf_counter()
    out = await run_backend(backend, requests, timeout=60)
    elapsed = time.perf_counter() - t0
    tokens = sum(out.count(r.request_id) for r in requests)
    assert tokens == 256 * 128
    assert tokens / elapsed > 20_000, f"{tokens / elapsed:.0f} tokens/s"


async def test_generated_ids_stay_in_the_configured_range(make_sim) -> None:
    backend = await make_sim(fast_sim(sample_ids_from=32, sample_ids_below=127))
    reqs = [req(f"r{i}", [5, 6, i], 64, temperature=0.8, seed=i) for i in range(8)]
    out = await run_backend(backend, reqs)
    ids = [t for r in reqs for t in out.tokens(r.request_id)]
    assert len(ids) == 8 * 64 and min(ids) >= 32 and max(ids) < 127
    assert len(set(ids)) > 60                      # spread over the range, not stuck on a few ids
    with pytest.raises(ValueError, match="sample_ids_from"):
        fast_sim(sample_ids_from=1000)             # nothing left to generate (vocab_size 1000)
