"""gRPC integration tests: a real Engine server (sim backend) over loopback on an ephemeral port."""

from __future__ import annotations

import asyncio

from engine_svc.backends.sim import SimBackend
from services.proto.tokenrelay.v1 import common_pb2, engine_pb2
from tests.engine.engine_testkit import Collector, StreamClient, engine_request, fast_sim, poll, req


async def test_multiplexed_requests_are_coalesced_into_few_messages(serve) -> None:
    stub, _ = await serve()
    client = StreamClient(stub)
    prompts = {f"r{i}": [i + 1, i + 2, i + 3, i + 4, i + 5] for i in range(8)}
    client.submit(*(engine_request(rid, p, 32) for rid, p in prompts.items()))
    client.half_close()
    await client.ended()
    # The same requests straight on a sim backend give the same tokens (deterministic engine).
    direct = SimBackend(fast_sim())
    await direct.start()
    ref = Collector()
    for rid, p in prompts.items():
        direct.submit(req(rid, p, 32), ref)
    await ref.wait(*prompts)
    await direct.close()
    total = 0
    for rid in prompts:
        assert client.tokens(rid) == ref.tokens(rid)
        total += len(client.tokens(rid))
        assert [c.finished for c in client.chunks[rid]].count(True) == 1
        assert client.last(rid).finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert total == 8 * 32
    # Tokens of different requests (and of several steps) share messages.
    assert client.messages < total / 4, client.messages


async def test_first_chunk_carries_cached_tokens(serve) -> None:
    stub, _ = await serve()
    client = StreamClient(stub)
    prompt = list(range(1, 14))  # 3 full blocks of 4 + 1
    client.submit(engine_request("cold", prompt, 4))
    await client.wait("cold")
    client.submit(engine_request("warm", prompt, 4), engine_request("other-tenant", prompt, 4, cache_salt="x"))
    await client.wait("warm", "other-tenant")
    assert client.chunks["cold"][0].cached_tokens == 0
    assert client.chunks["warm"][0].cached_tokens == 12
    assert client.chunks["other-tenant"][0].cached_tokens == 0
    load = await stub.GetLoad(engine_pb2.LoadRequest())
    assert load.cached_tokens_total == 12 and load.prompt_tokens_total == 3 * 13
    client.half_close()
    await client.ended()


async def test_stop_token_is_included_and_reason_is_stop(serve) -> None:
    stub, _ = await serve(sim_eos_probability=1.0)
    client = StreamClient(stub)
    client.submit(engine_request("eos", [1, 2, 3], 16, eos=[2]),
                  engine_request("ignore", [1, 2, 3], 5, eos=[2], ignore_eos=True))
    await client.wait("eos", "ignore")
    assert client.tokens("eos") == [2]
    assert client.last("eos").finish_reason == common_pb2.FINISH_REASON_STOP
    assert client.tokens("ignore") == [2] * 5
    assert client.last("ignore").finish_reason == common_pb2.FINISH_REASON_LENGTH
    client.cancel()


async def test_per_request_errors_are_reported_in_band_and_the_stream_goes_on(serve) -> None:
    stub, _ = await serve(sim_max_context=64, sim_decode_step_time=0.001)
    client = StreamClient(stub)
    client.submit(
        engine_request("ok-1", [1, 2, 3], 40),
        engine_request("empty", [], 4),
        engine_request("zero", [1, 2], 0),
        engine_request("too-long", list(range(60)), 10),
        engine_request("bad-token", [1, 5000], 4),
        engine_request("bad-temp", [1], 4, temperature=-1.0),
        engine_request("ok-1", [9, 9], 4),  # duplicate of a live id
    )
    client.submit(engine_request("ok-2", [4, 5, 6], 6))
    await client.wait("ok-2", "empty", "zero", "too-long", "bad-token", "bad-temp")
    expected = {"empty": "EMPTY_PROMPT", "zero": "INVALID_MAX_TOKENS", "too-long": "CONTEXT_LENGTH_EXCEEDED",
                "bad-token": "INVALID_TOKEN_ID", "bad-temp": "INVALID_SAMPLING"}
    for rid, reason in expected.items():
        chunk = client.last(rid)
        assert chunk.finished and chunk.finish_reason == common_pb2.FINISH_REASON_ERROR
        assert chunk.error_reason == reason and chunk.error_message
    dup = [c for c in client.chunks["ok-1"] if c.error_reason]
    assert len(dup) == 1 and dup[0].error_reason == "DUPLICATE_REQUEST_ID"
    # The duplicate's error chunk shares the id; the live request still runs to its end.
    await poll(lambda: client.last("ok-1").finish_reason == common_pb2.FINISH_REASON_LENGTH, what="ok-1")
    assert len(client.tokens("ok-1")) == 40 and len(client.tokens("ok-2")) == 6
    assert client.last("ok-1").finish_reason == common_pb2.FINISH_REASON_LENGTH
    client.half_close()
    await client.ended()


async def test_engine_overloaded_is_reported_in_band(serve) -> None:
    stub, _ = await serve(sim_max_batch_size=1, max_queued=1, sim_decode_step_time=0.001)
    client = StreamClient(stub)
    client.submit(*(engine_request(f"r{i}", [1, 2], 300) for i in range(3)))
    await client.wait("r2")
    assert client.last("r2").error_reason == "OVERLOADED"
    load = await stub.GetLoad(engine_pb2.LoadRequest())
    assert (load.active_requests, load.queued_requests) == (1, 1)
    client.cancel()


async def test_abort_in_band_and_unary(serve) -> None:
    stub, _ = await serve(sim_decode_step_time=0.002)
    a, b = StreamClient(stub), StreamClient(stub)
    a.submit(engine_request("a-long", [1, 2], 400), engine_request("a-short", [3, 4], 10))
    b.submit(engine_request("b-long", [5, 6], 400))
    await poll(lambda: a.tokens("a-long") and b.tokens("b-long"), what="first tokens")
    a.abort("a-long", "not-there")
    await a.wait("a-long", "a-short")
    assert a.last("a-long").finish_reason == common_pb2.FINISH_REASON_CANCELLED
    assert a.last("a-short").finish_reason == common_pb2.FINISH_REASON_LENGTH
    reply = await stub.Abort(engine_pb2.EngineAbortRequest(request_ids=["b-long", "nope"]))
    assert reply.aborted == 1
    await b.wait("b-long")
    assert b.last("b-long").finish_reason == common_pb2.FINISH_REASON_CANCELLED
    assert 0 < len(b.tokens("b-long")) < 400
    load = await stub.GetLoad(engine_pb2.LoadRequest())
    assert (load.active_requests, load.queued_requests, load.kv_blocks_used) == (0, 0, 0)
    for client in (a, b):
        client.half_close()
        await client.ended()


async def test_a_broken_stream_aborts_every_request_it_carried(serve) -> None:
    stub, engine = await serve(sim_decode_step_time=0.002, sim_max_batch_size=2)
    survivor = StreamClient(stub)
    survivor.submit(engine_request("keep", [7, 7], 60))
    doomed = StreamClient(stub)
    doomed.submit(*(engine_request(f"d{i}", [i, i], 400) for i in range(4)))
    await poll(lambda: doomed.tokens("d0"), what="doomed stream running")
    load = await stub.GetLoad(engine_pb2.LoadRequest())
    assert load.active_requests + load.queued_requests == 5
    doomed.cancel()  # the router went away

    async def drained() -> bool:
        r = await stub.GetLoad(engine_pb2.LoadRequest())
        return r.active_requests + r.queued_requests <= 1 and engine.live <= 1

    deadline = asyncio.get_running_loop().time() + 10
    while not await drained():
        assert asyncio.get_running_loop().time() < deadline, "requests of the broken stream still live"
        await asyncio.sleep(0.01)
    await survivor.wait("keep")
    assert len(survivor.tokens("keep")) == 60
    load = await stub.GetLoad(engine_pb2.LoadRequest())
    assert (load.active_requests, load.queued_requests, load.kv_blocks_used) == (0, 0, 0)
    survivor.cancel()


async def test_get_load_reports_the_backend(serve) -> None:
    stub, _ = await serve(model="sim-test")
    load = await stub.GetLoad(engine_pb2.LoadRequest())
    assert load.backend == "sim" and load.model == "sim-test"
    assert load.max_active_requests == 16 and load.kv_blocks_total == 512 and load.tokens_per_block == 4
    assert load.max_context == 512


async def test_drain_refuses_new_work_and_ends_streams_when_idle(serve) -> None:
    stub, engine = await serve(sim_decode_step_time=0.002)
    busy, idle = StreamClient(stub), StreamClient(stub)
    busy.submit(engine_request("running", [1, 2], 300))
    idle.submit(engine_request("quick", [3], 2))
    await idle.wait("quick")
    await poll(lambda: busy.tokens("running"), what="running")
    engine.drain()
    await idle.ended()  # nothing live on it: it ends at once
    busy.submit(engine_request("late", [4], 4))
    await busy.wait("late")
    assert busy.last("late").error_reason == "SHUTTING_DOWN"   # retryable: routers go elsewhere
    await busy.wait("running")
    assert len(busy.tokens("running")) == 300
    await busy.ended()
