"""The `trtllm` backend against a fake `tensorrt_llm` (tests/fakes/tensorrt_llm, written from the
documented API only), put in sys.modules for each test: streaming, EOS ids from the model's
generation config, abort, a request that errors mid-stream, an executor that dies (health DEAD,
retryable ENGINE_UNAVAILABLE, NOT_SERVING), stats and KV events mapped into the contract."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import pathlib
import sys
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine_svc.backends import create_backend
from engine_svc.backends.base import FinishReason
from engine_svc.backends.events import HealthState, KvEventType
from engine_svc.backends.trtllm import TrtllmBackend, TrtllmConfig
from engine_svc.backends.trtllm_map import kv_event_from_trtllm, stats_from_trtllm
from engine_svc.config import EngineSettings
from engine_svc.engine import Engine
from services.channels import open_channel
from services.errors import Reason, TokenrelayError
from services.proto.tokenrelay.v1 import engine_pb2, engine_pb2_grpc
from tests.engine.engine_testkit import Collector, StreamClient, engine_request, poll, req

FAKES = pathlib.Path(__file__).resolve().parents[1] / "fakes" / "tensorrt_llm"
END_ID, EXTRA_EOS = 999, 14          # the fake's tokens for prompt [1, 2, 3] are 7, 14, 21, ...


@pytest.fixture
def fake_trtllm() -> Iterator[Any]:
    saved = {name: mod for name, mod in sys.modules.items() if name.split(".")[0] == "tensorrt_llm"}
    spec = importlib.util.spec_from_file_location("tensorrt_llm", FAKES / "__init__.py",
                                                  submodule_search_locations=[str(FAKES)])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["tensorrt_llm"] = module
    spec.loader.exec_module(module)
    try:
        yield module
    finally:
        for name in [n for n in sys.modules if n.split(".")[0] == "tensorrt_llm"]:
            del sys.modules[name]
        sys.modules.update(saved)


@pytest.fixture
def model_dir(tmp_path: pathlib.Path) -> str:
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [END_ID, EXTRA_EOS]}))
    return str(tmp_path)


@pytest.fixture
async def trtllm(fake_trtllm: Any, model_dir: str) -> AsyncIterator[Any]:
    engines: list[Engine] = []

    async def make(**overrides: Any) -> tuple[Engine, TrtllmBackend, Any]:
        config = TrtllmConfig(model=model_dir, tokens_per_block=4, poll_timeout=0.01, **overrides)
        backend = create_backend(EngineSettings(backend="trtllm", model=model_dir,
                                                **{f"trtllm_{k}": v for k, v in config.model_dump().items()
                                                   if k != "model"}))
        engine = Engine(backend, max_queued=16)
        await engine.start()
        engines.append(engine)
        return engine, backend, fake_trtllm.instances[-1]

    yield make
    for engine in engines:
        await engine.close()


async def test_streams_token_ids_with_the_documented_llm_arguments(trtllm) -> None:
    engine, backend, llm = await trtllm(max_batch_size=64, scheduler_policy="max_utilization", kv_cache_dtype="fp8")
    assert llm.skip_tokenizer_init and llm.kwargs["backend"] == "pytorch" and llm.kwargs["max_batch_size"] == 64
    assert llm.kwargs["enable_iter_perf_stats"] and llm.kv.enable_block_reuse and llm.kv.dtype == "fp8"
    assert llm.kv.event_buffer_max_size == 4096 and llm.scheduler.capacity_scheduler_policy.name == "MAX_UTILIZATION"
    sink = Collector()
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13]          # two full blocks of 4
    engine.submit(req("a", prompt, 5, cache_salt="tenant-a"), sink)
    await sink.wait("a")
    total = sum(prompt)
    assert sink.tokens("a") == [(total + 7 * i + 1) % 1000 for i in range(5)]
    assert sink.last("a").finish_reason is FinishReason.LENGTH and sink.events["a"][0].cached_tokens == 0
    out = next(o for o in _outputs(llm) if o.prompt_token_ids == prompt)
    assert out.salt == "tenant-a" and out.params.end_id == END_ID and out.params.max_tokens == 5
    assert out.params.stop_token_ids == [EXTRA_EOS] and out.params.detokenize is False
    # The same prompt and salt again: the fake reuses both blocks; another salt reuses nothing.
    engine.submit(req("b", prompt, 2, cache_salt="tenant-a"), sink)
    engine.submit(req("c", prompt, 2, cache_salt="tenant-b"), sink)
    await sink.wait("b", "c")
    assert sink.events["b"][0].cached_tokens == 8 and sink.events["c"][0].cached_tokens == 0
    assert backend.load().cached_tokens_total == 8 and engine.live == 0


def _outputs(llm: Any) -> list[Any]:
    return list(llm.seen)


async def test_extra_eos_from_the_generation_config_stops_the_request(trtllm) -> None:
    engine, _, _ = await trtllm()
    sink = Collector()
    engine.submit(req("eos", [1, 2, 3], 50), sink)
    engine.submit(req("ignore", [1, 2, 3], 4, ignore_eos=True), sink)
    await sink.wait("eos", "ignore")
    assert sink.tokens("eos") == [7, EXTRA_EOS] and sink.last("eos").finish_reason is FinishReason.STOP
    assert sink.tokens("ignore") == [7, 14, 21, 28] and sink.last("ignore").finish_reason is FinishReason.LENGTH


async def test_abort_calls_request_output_abort_and_frees_the_request(trtllm) -> None:
    engine, backend, llm = await trtllm()
    sink = Collector()
    engine.submit(req("long", [4, 5], 10_000), sink)
    await poll(lambda: sink.count("long") >= 2, what="tokens")
    assert engine.abort(["long"]) == 1
    assert sink.last("long").finish_reason is FinishReason.CANCELLED
    assert llm.aborted and not llm._active and engine.live == 0
    # A consumer task cancelled from outside (not through abort) still aborts in its finally.
    engine.submit(req("cut", [4, 5], 10_000), sink)
    await poll(lambda: sink.count("cut") >= 1, what="tokens")
    backend._live["cut"].task.cancel()
    await poll(lambda: not llm._active, what="the executor dropped it")


async def test_a_request_that_errors_mid_stream_fails_alone(trtllm, fake_trtllm) -> None:
    engine, backend, llm = await trtllm()
    sink = Collector()
    engine.submit(req("doomed", [1], 10_000), sink)
    engine.submit(req("fine", [2], 20), sink)
    await poll(lambda: sink.count("doomed") >= 2, what="tokens")
    doomed = next(o for o in llm._active.values() if o.prompt_token_ids == [1])
    llm._fake_fail(doomed.request_id, fake_trtllm.executor.RequestError("bad logits"))
    await sink.wait("doomed", "fine")
    last = sink.last("doomed")
    assert last.error_reason == Reason.ENGINE_ERROR and "bad logits" in last.error_message, sink.events["doomed"][-2:]
    assert sink.count("doomed") >= 2 and sink.last("fine").finish_reason is FinishReason.LENGTH
    assert backend.health() is HealthState.SERVING and engine.live == 0


async def test_an_executor_that_dies_fails_everything_retryably_and_says_not_serving(fake_trtllm, model_dir) -> None:
    from engine_svc.app import start_engine

    engine, server = await start_engine(EngineSettings(backend="trtllm", model=model_dir, port=0,
                                                       trtllm_poll_timeout=0.01))
    channel = open_channel(server.address)
    try:
        stub = engine_pb2_grpc.EngineStub(channel)
        client = StreamClient(stub)
        client.submit(engine_request("a", [1, 2], 10_000), engine_request("b", [3], 10_000))
        await poll(lambda: len(client.tokens("a")) >= 1 and len(client.tokens("b")) >= 1, what="tokens")
        llm = fake_trtllm.instances[-1]
        llm._fake_kill(RuntimeError("executor worker died: CUDA error"))
        await client.wait("a", "b")
        for rid in ("a", "b"):
            assert client.last(rid).error_reason == Reason.ENGINE_UNAVAILABLE
        assert Reason.ENGINE_UNAVAILABLE.retryable and engine.health is HealthState.DEAD
        await client.ended()
        health = health_pb2_grpc.HealthStub(channel)

        async def not_serving() -> bool:
            resp = await health.Check(health_pb2.HealthCheckRequest(service=""))
            return resp.status == health_pb2.HealthCheckResponse.NOT_SERVING

        await poll(not_serving, what="NOT_SERVING")
        load = await stub.GetLoad(engine_pb2.LoadRequest())
        assert load.health == engine_pb2.ENGINE_HEALTH_DEAD and load.draining
        with pytest.raises(TokenrelayError) as refused:
            engine.submit(req("after", [1], 2), Collector())
        assert refused.value.reason == Reason.ENGINE_UNAVAILABLE
    finally:
        await channel.close()
        await server.stop(0)
        await engine.close()


async def test_a_shut_down_executor_is_noticed_at_submit(trtllm) -> None:
    engine, backend, llm = await trtllm()
    llm.shutdown()
    with pytest.raises(TokenrelayError) as refused:
        engine.submit(req("x", [1], 2), Collector())
    assert refused.value.reason == Reason.ENGINE_UNAVAILABLE and backend.health() is HealthState.DEAD


async def test_a_failing_poll_means_a_dead_executor(trtllm) -> None:
    engine, backend, llm = await trtllm()

    def broken(timeout: float = 2) -> Any:
        raise RuntimeError("executor is gone")

    sink = Collector()
    engine.submit(req("x", [1], 10_000), sink)
    llm.get_stats_async = broken
    await sink.wait("x")
    assert sink.last("x").error_reason == Reason.ENGINE_UNAVAILABLE and backend.health() is HealthState.DEAD


async def test_stats_and_kv_events_are_polled_into_the_contract(trtllm) -> None:
    engine, backend, _ = await trtllm()
    sub = engine.subscribe_kv_events()
    sink = Collector()
    prompt = list(range(1, 10))
    for rid in ("cold", "warm"):
        engine.submit(req(rid, prompt, 3), sink)
        await sink.wait(rid)
    stats = await poll(lambda: (s := engine.iteration_stats()).kv_blocks_reused == 2 and s, what="stats")
    assert stats.iteration > 0 and stats.kv_blocks_total == 1000 and stats.tokens_per_block == 4
    assert stats.kv_blocks_missed == 2 and stats.kv_cache_hit_rate == pytest.approx(0.5)
    assert backend.load().kv_blocks_total == 1000
    events, dropped = await asyncio.wait_for(anext(aiter(sub)), 5)
    stored = events[0]
    assert dropped == 0 and stored.type is KvEventType.STORED and stored.parent_hash is None
    assert [b.token_ids for b in stored.blocks] == [tuple(prompt[:4]), tuple(prompt[4:8])]
    sub.close()


def test_mapping_of_documented_shapes() -> None:
    stats = stats_from_trtllm(json.dumps({
        "iter": 7, "iterLatencyMS": 12.5, "numActiveRequests": 3, "numQueuedRequests": 2, "maxNumActiveRequests": 64,
        "kvCacheStats": {"maxNumBlocks": 100, "freeNumBlocks": 60, "usedNumBlocks": 40, "tokensPerBlock": 32,
                         "reusedBlocks": 9, "missedBlocks": 3, "cacheHitRate": 0.75},
        "inflightBatchingStats": {"numContextRequests": 1, "numGenRequests": 2, "numPausedRequests": 1}}))
    assert (stats.iteration, stats.active, stats.queued) == (7, 3, 2)
    assert (stats.kv_blocks_used, stats.kv_blocks_free) == (40, 60)
    assert (stats.context_requests, stats.generation_requests, stats.paused_requests) == (1, 2, 1)
    assert stats.kv_cache_hit_rate == 0.75 and stats.iteration_latency_ms == 12.5
    removed = kv_event_from_trtllm({"event_id": 4, "window_size": 0,
                                    "data": {"type": "removed", "block_hashes": [1, 2]}})
    assert removed is not None and removed.type is KvEventType.REMOVED and removed.block_hashes == (1, 2)
    created = kv_event_from_trtllm({"event_id": 0, "data": {"type": "created", "num_blocks_per_cache_level": [100, 0]}})
    assert created is not None and created.num_blocks_per_cache_level == (100, 0)
    updated = kv_event_from_trtllm({"event_id": 5, "data": {"type": "updated", "block_hash": 8, "cache_level":
                                                            {"old_value": 0, "new_value": 1}, "priority": None}})
    assert updated is not None and updated.blocks[0].block_hash == 8 and updated.blocks[0].cache_level == 1
    assert kv_event_from_trtllm({"event_id": 6, "data": {"type": "brand-new"}}) is None


def test_without_tensorrt_llm_the_backend_is_one_line_naming_the_extra(model_dir: str) -> None:
    if importlib.util.find_spec("tensorrt_llm") is not None:
        pytest.skip("tensorrt_llm is installed here")
    with pytest.raises(ValueError, match=r"needs the 'trtllm' extra .*pip install 'tokenrelay\[trtllm\]'"):
        create_backend(EngineSettings(backend="trtllm", model=model_dir))
