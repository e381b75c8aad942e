"""The `trtllm-grpc` backend against a fake `TrtllmService` (a real grpc.aio server on an ephemeral port)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

pytest.importorskip("smg_grpc_proto", reason="the trtllm-grpc extra (smg-grpc-proto) is not installed")

from engine_svc.backends import create_backend
from engine_svc.backends.base import FinishReason
from engine_svc.backends.events import HealthState, KvEventType
from engine_svc.backends.trtllm_grpc import TrtllmGrpcBackend
from engine_svc.backends.trtllm_grpc_config import TrtllmGrpcConfig
from engine_svc.config import EngineSettings
from services.errors import Reason
from tests.engine.engine_testkit import Collector, poll, req
from tests.fakes.trtllm_grpc_fake import ERROR_AFTER_2, VOCAB, FakeTrtllmService, start_fake


def expected(prompt: list[int], n: int) -> list[int]:
    return [(prompt[-1] + k + 1) % VOCAB for k in range(n)]


@pytest.fixture
async def fake() -> AsyncIterator[tuple[FakeTrtllmService, Any, str]]:
    service = FakeTrtllmService()
    server, address = await start_fake(service)
    yield service, server, address
    service.kv_batches.put_nowait(None)
    await server.stop(0)


async def started(address: str, **overrides: Any) -> TrtllmGrpcBackend:
    values: dict[str, Any] = {"address": address, "connect_timeout": 5.0, "health_interval": 0.0,
                              "kv_events": False}
    values.update(overrides)
    backend = TrtllmGrpcBackend(TrtllmGrpcConfig(**values))
    await backend.start()
    return backend


async def test_streams_tokens_and_reads_the_model_info(fake: Any) -> None:
    service, _, address = fake
    backend = await started(address)
    try:
        assert (backend.model, backend.max_context, backend.vocab_size) == ("fake-llama-8b", 4096, VOCAB)
        assert backend.load().max_active == 8
        sink = Collector()
        backend.submit(req("a", [1, 2, 3], max_tokens=5, eos_token_ids=[900], stop_token_ids=[901]), sink)
        await sink.wait("a")
        assert sink.tokens("a") == expected([3], 5)   # the final token, in chunk and complete, once
        last = sink.last("a")
        assert last.finish_reason is FinishReason.LENGTH
        assert sink.events["a"][0].cached_tokens == 1
        sent = service.requests[0]
        assert list(sent.tokenized.input_token_ids) == [1, 2, 3] and sent.max_tokens == 5 and sent.streaming
        assert sorted(sent.stop_token_ids) == [900, 901] and sent.include_stop_token_in_output
        assert sent.sampling_config.top_k == 1   # greedy
        assert sent.output_config.exclude_input_from_output
        assert backend.load().active == 0 and backend.generated_tokens_total == 5
    finally:
        await backend.close()


async def test_a_stop_id_ends_the_request_and_is_emitted(fake: Any) -> None:
    service, _, address = fake
    backend = await started(address)
    try:
        sink = Collector()
        backend.submit(req("s", [10], max_tokens=50, eos_token_ids=[13], temperature=0.7, top_p=0.9, seed=5,
                           cache_salt="tenant-a"), sink)
        await sink.wait("s")
        assert sink.tokens("s") == [11, 12, 13]
        assert sink.last("s").finish_reason is FinishReason.STOP
        sampling = service.requests[0].sampling_config
        assert sampling.temperature == pytest.approx(0.7) and sampling.top_p == pytest.approx(0.9)
        assert sampling.seed == 5 and not sampling.HasField("top_k")
        assert service.requests[0].HasField("cache_salt_id")
    finally:
        await backend.close()


async def test_abort_cancels_at_once_and_ends_the_server_side_request(fake: Any) -> None:
    service, _, address = fake
    service.step = 0.005   # the fake engine's speed: the request would run for 50 s
    backend = await started(address)
    try:
        sink = Collector()
        backend.submit(req("long", [1], max_tokens=10_000), sink)
        await poll(lambda: sink.count("long") >= 1, what="a first token")
        assert backend.abort("long")
        assert sink.last("long").finished and sink.last("long").finish_reason is FinishReason.CANCELLED
        assert not backend.abort("long")
        await poll(lambda: not service.live, what="the server to end the request")
        await poll(lambda: service.aborts, what="the Abort RPC")
        assert service.aborts[0].startswith("long#")
        n = len(sink.events["long"])
        backend.submit(req("next", [5], max_tokens=2), sink)   # the backend still serves
        await sink.wait("next")
        assert len(sink.events["long"]) == n   # nothing after the CANCELLED event
    finally:
        await backend.close()


async def test_an_error_mid_stream_fails_only_that_request(fake: Any) -> None:
    _, _, address = fake
    backend = await started(address)
    try:
        sink = Collector()
        backend.submit(req("bad", [ERROR_AFTER_2, 4], max_tokens=10), sink)
        await sink.wait("bad")
        last = sink.last("bad")
        assert sink.tokens("bad") == expected([4], 2)
        assert last.finish_reason is FinishReason.ERROR and last.error_reason == Reason.ENGINE_ERROR
        assert "fake engine failure" in last.error_message
        assert backend.health() is HealthState.SERVING
        backend.submit(req("good", [4], max_tokens=3), sink)
        await sink.wait("good")
        assert sink.last("good").finish_reason is FinishReason.LENGTH
    finally:
        await backend.close()


async def test_the_server_going_away_fails_requests_retryably_and_health_says_so(fake: Any) -> None:
    service, server, address = fake
    service.step = 0.005
    backend = await started(address)
    changes: list[HealthState] = []
    backend.health_listener = changes.append
    try:
        sink = Collector()
        backend.submit(req("r1", [1], max_tokens=10_000), sink)
        backend.submit(req("r2", [2], max_tokens=10_000), sink)
        await poll(lambda: sink.count("r1") and sink.count("r2"), what="both requests streaming")
        await server.stop(0)
        await sink.wait("r1", "r2")
        for rid in ("r1", "r2"):
            last = sink.last(rid)
            assert last.finish_reason is FinishReason.ERROR and last.error_reason == Reason.ENGINE_UNAVAILABLE
            assert Reason.ENGINE_UNAVAILABLE.retryable
        assert backend.health() is HealthState.DEAD and changes == [HealthState.DEAD]
        assert "trtllm-grpc" in backend.health_detail
        with pytest.raises(Exception) as refused:
            backend.submit(req("r3", [3], max_tokens=1), sink)
        assert getattr(refused.value, "reason", "") == Reason.ENGINE_UNAVAILABLE
    finally:
        await backend.close()


async def test_an_unhealthy_health_check_makes_the_backend_unavailable_until_it_is_ok_again(fake: Any) -> None:
    service, _, address = fake
    service.step = 0.005
    backend = await started(address, health_interval=0.01)
    changes: list[HealthState] = []
    backend.health_listener = changes.append
    try:
        sink = Collector()
        backend.submit(req("r", [1], max_tokens=10_000), sink)
        await poll(lambda: sink.count("r"), what="a first token")
        service.health_status = "RuntimeError: executor died"
        await sink.wait("r")
        assert sink.last("r").error_reason == Reason.ENGINE_UNAVAILABLE
        assert backend.health() is HealthState.UNAVAILABLE and "executor died" in backend.health_detail
        with pytest.raises(Exception) as refused:
            backend.submit(req("r2", [2], max_tokens=1), sink)
        assert getattr(refused.value, "reason", "") == Reason.ENGINE_UNAVAILABLE
        service.health_status = "OK"
        await poll(lambda: backend.health() is HealthState.SERVING, what="serving again")
        assert changes == [HealthState.UNAVAILABLE, HealthState.SERVING] and backend.health_detail == ""
        backend.submit(req("r3", [3], max_tokens=4), sink)
        await sink.wait("r3")
        assert sink.tokens("r3") == expected([3], 4)
    finally:
        await backend.close()


async def test_a_restarted_server_is_served_again_and_its_kv_events_followed_from_the_start() -> None:
    """The server process goes away and comes back on its address (a restarted trtllm-serve): live
    requests fail retryably, the backend is UNAVAILABLE (never DEAD), then serves again by itself,
    and follows the new server's KV events from sequence 0 (its subscribers were ended). A server
    back with another model makes it DEAD."""
    first = FakeTrtllmService(step=0.005)
    server, address = await start_fake(first)
    port = int(address.rsplit(":", 1)[1])
    backend = await started(address, kv_events=True, health_interval=0.02, health_timeout=0.5, connect_timeout=10.0)
    second, third = FakeTrtllmService(), FakeTrtllmService()
    restarted = again = None
    try:
        subscription = backend.kv_events()
        first.kv_batches.put_nowait(first.stored(1, None, (21, [1, 2])))
        batch, _ = await asyncio.wait_for(anext(aiter(subscription)), 10)
        assert [e.type for e in batch] == [KvEventType.STORED]
        sink = Collector()
        backend.submit(req("r1", [1], max_tokens=10_000), sink)
        await poll(lambda: sink.count("r1"), what="streaming")
        first.kv_batches.put_nowait(None)
        await server.stop(0)
        await sink.wait("r1")
        assert sink.last("r1").error_reason == Reason.ENGINE_UNAVAILABLE
        await poll(lambda: backend.health() is HealthState.UNAVAILABLE, what="unavailable")
        assert [b async for b in subscription] == []           # the subscription was ended
        restarted, _ = await start_fake(second, port=port)
        await poll(lambda: backend.health() is HealthState.SERVING, timeout=10, what="serving again")
        await poll(lambda: second.kv_subscriptions, what="the new server followed")
        assert second.kv_subscriptions == [0] and backend.recoveries == 1
        backend.submit(req("r2", [5], max_tokens=3), sink)
        await sink.wait("r2")
        assert sink.tokens("r2") == expected([5], 3)
        second.kv_batches.put_nowait(None)
        await restarted.stop(0)
        restarted = None
        await poll(lambda: backend.health() is HealthState.UNAVAILABLE, what="unavailable again")
        third.max_seq_len = 8192
        again, _ = await start_fake(third, port=port)
        await poll(lambda: backend.health() is HealthState.DEAD, timeout=10, what="dead: another model")
        assert "another model" in backend.health_detail
    finally:
        await backend.close()
        for service, srv in ((second, restarted), (third, again)):
            service.kv_batches.put_nowait(None)
            if srv is not None:
                await srv.stop(0)


async def test_kv_events_map_to_the_contract(fake: Any) -> None:
    service, _, address = fake
    backend = await started(address, kv_events=True)
    try:
        assert backend.emits_kv_events
        subscription = backend.kv_events()
        load = service.common.EngineLoad(running_requests=3, waiting_requests=2, max_running_requests=8,
                                         sample=7, cache_hit_rate=0.5)
        service.kv_batches.put_nowait(service.stored(1, None, (11, [1, 2]), (12, [3, 4]), load=load))
        service.kv_batches.put_nowait(service.stored(2, 12, (13, [5, 6])))
        service.kv_batches.put_nowait(service.removed(3, 11))
        service.kv_batches.put_nowait(service.cleared(6))   # batches 4 and 5 were lost
        events: list[Any] = []

        async def collect() -> None:
            async for batch, _dropped in subscription:
                events.extend(batch)
                if len(events) >= 4:
                    return

        await asyncio.wait_for(collect(), 10)
        subscription.close()
        kinds = [e.type for e in events]
        assert kinds == [KvEventType.STORED, KvEventType.STORED, KvEventType.REMOVED, KvEventType.REMOVED]
        assert [b.block_hash for b in events[0].blocks] == [11, 12] and events[0].parent_hash is None
        assert events[0].blocks[1].token_ids == (3, 4)
        assert events[1].parent_hash == 12
        assert events[2].block_hashes == (11,)
        assert sorted(events[3].block_hashes) == [12, 13]   # cleared: every block still stored
        assert [e.event_id for e in events] == [0, 1, 2, 5]   # the lost batches show as a gap
        assert service.kv_subscriptions == [0]
        stats = backend.iteration_stats()
        assert (stats.active, stats.queued, stats.max_active, stats.iteration) == (3, 2, 8, 7)
        assert stats.kv_cache_hit_rate == pytest.approx(0.5)
    finally:
        await backend.close()


async def test_the_kv_subscription_resumes_after_the_next_sequence_number() -> None:
    first = FakeTrtllmService()
    server, address = await start_fake(first)
    backend = await started(address, kv_events=True, connect_timeout=10.0)
    second = FakeTrtllmService()
    restarted = None
    try:
        subscription = backend.kv_events()
        first.kv_batches.put_nowait(first.stored(1, None, (21, [1, 2])))
        batch, _ = await asyncio.wait_for(anext(aiter(subscription)), 10)
        assert [e.type for e in batch] == [KvEventType.STORED]
        await server.stop(0)   # the server restarts on the same address
        restarted, _ = await start_fake(second, port=int(address.rsplit(":", 1)[1]))
        await poll(lambda: second.kv_subscriptions, what="the resubscription")
        assert second.kv_subscriptions == [2]
        second.kv_batches.put_nowait(second.removed(2, 21))
        batch, _ = await asyncio.wait_for(anext(aiter(subscription)), 10)
        assert [(e.type, e.event_id) for e in batch] == [(KvEventType.REMOVED, 1)]
        subscription.close()
    finally:
        await backend.close()
        second.kv_batches.put_nowait(None)
        if restarted is not None:
            await restarted.stop(0)


async def test_a_server_without_kv_events_is_not_an_error(fake: Any) -> None:
    service, _, address = fake
    service.kv_unimplemented = True
    backend = await started(address, kv_events=True)
    try:
        sink = Collector()
        backend.submit(req("a", [1], max_tokens=2), sink)
        await sink.wait("a")
        assert backend.health() is HealthState.SERVING
        await poll(lambda: not backend.emits_kv_events, what="the subscription given up")
    finally:
        await backend.close()


async def test_no_server_at_start_is_one_clear_error() -> None:
    backend = TrtllmGrpcBackend(TrtllmGrpcConfig(address="127.0.0.1:1", connect_timeout=0.2))
    with pytest.raises(RuntimeError, match=r"no TrtllmService at 127\.0\.0\.1:1 "):
        await backend.start()


def test_registered_with_its_settings_section(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = EngineSettings(backend="trtllm-grpc", trtllm_grpc={"address": "10.0.0.1:9000"})
    backend = create_backend(settings)
    assert isinstance(backend, TrtllmGrpcBackend) and backend.config.address == "10.0.0.1:9000"
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "smg_grpc_proto" else real(name, *a))
    with pytest.raises(ValueError, match=r"needs the 'trtllm-grpc' extra .*tokenrelay\[trtllm-grpc\]"):
        create_backend(settings)
