"""The engine contract's optional parts (issue 13), implemented by `sim` first: KV-cache events,
iteration stats, health (a dead engine fails its requests with a retryable reason and says
NOT_SERVING), deadlines and priority; and the safe defaults a backend without them gets."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine_svc.backends.base import Backend, FinishReason, GenerationEvent, LoadSnapshot
from engine_svc.backends.events import HealthState, KvEvent, KvEventHub, KvEventType
from engine_svc.backends.sim import SimBackend
from engine_svc.engine import Engine
from services.channels import open_channel
from services.errors import Reason, TokenrelayError
from services.proto.tokenrelay.v1 import common_pb2, engine_pb2
from tests.engine.engine_testkit import Collector, StreamClient, engine_request, fast_sim, poll, req


@pytest.fixture
async def engine_of() -> AsyncIterator:
    started: list[Engine] = []

    async def make(backend: Backend, max_queued: int = 64) -> Engine:
        engine = Engine(backend, max_queued)
        await engine.start()
        started.append(engine)
        return engine

    yield make
    for engine in started:
        await engine.close()


async def _next_batch(sub, timeout: float = 5.0) -> tuple[list[KvEvent], int]:
    return await asyncio.wait_for(anext(aiter(sub)), timeout)


async def test_sim_publishes_stored_and_removed_events_with_chained_hashes(engine_of) -> None:
    backend = SimBackend(fast_sim(num_blocks=8, tokens_per_block=4))
    engine = await engine_of(backend)
    sub = engine.subscribe_kv_events()
    sink = Collector()
    prompt = list(range(1, 13))                       # three full blocks
    engine.submit(req("a", prompt, 4), sink)           # decode fills a fourth block
    await sink.wait("a")
    events, dropped = sub.take()
    assert dropped == 0 and [e.type for e in events] == [KvEventType.STORED, KvEventType.STORED]
    hashes = backend.kv.prompt_hashes(prompt, "")
    first, second = events
    assert first.parent_hash is None and [b.block_hash for b in first.blocks] == hashes
    assert [b.token_ids for b in first.blocks] == [tuple(prompt[i:i + 4]) for i in (0, 4, 8)]
    assert second.parent_hash == hashes[-1] and second.blocks[0].token_ids == tuple(sink.tokens("a"))
    assert second.event_id == first.event_id + 1
    # Another prompt needs the whole cache: the cached blocks are evicted and reported removed.
    engine.submit(req("b", list(range(100, 128)), 4), sink)
    await sink.wait("b")
    events, _ = sub.take()
    removed = [h for e in events if e.type is KvEventType.REMOVED for h in e.block_hashes]
    assert set(removed) == {*hashes, second.blocks[0].block_hash}
    assert [e.event_id for e in events] == list(range(second.event_id + 1, second.event_id + 1 + len(events)))
    sub.close()
    assert backend.kv_event_hub.subscribers == 0


async def test_events_are_built_only_while_someone_subscribes(engine_of) -> None:
    backend = SimBackend(fast_sim())
    engine = await engine_of(backend)
    sink = Collector()
    engine.submit(req("quiet", list(range(16)), 2), sink)
    await sink.wait("quiet")
    assert backend.kv.take_events() == [] and backend.kv_event_hub.published == 0


def test_a_slow_subscriber_loses_its_oldest_events_and_is_told_how_many() -> None:
    hub = KvEventHub(capacity=3)
    sub = hub.subscribe()
    hub.publish([KvEvent(i, KvEventType.REMOVED, block_hashes=(i,)) for i in range(5)])
    events, dropped = sub.take()
    assert [e.event_id for e in events] == [2, 3, 4] and dropped == 2
    hub.close()
    assert sub.closed and hub.subscribe().closed


async def test_iteration_stats_count_reused_blocks(engine_of) -> None:
    backend = SimBackend(fast_sim(tokens_per_block=4))
    engine = await engine_of(backend)
    sink = Collector()
    prompt = list(range(1, 18))                       # four full blocks (+1 token)
    for rid in ("cold", "warm"):
        engine.submit(req(rid, prompt, 2), sink)
        await sink.wait(rid)
    stats = engine.iteration_stats()
    assert stats.iteration == backend.steps > 0
    assert (stats.kv_blocks_reused, stats.kv_blocks_missed) == (4, 4)
    assert stats.kv_cache_hit_rate == pytest.approx(0.5)
    assert stats.kv_blocks_used == 0 and stats.kv_blocks_free == stats.kv_blocks_total == 256
    assert sink.last("warm").finish_reason is FinishReason.LENGTH and sink.events["warm"][0].cached_tokens == 16


async def test_higher_priority_is_admitted_first(engine_of) -> None:
    engine = await engine_of(SimBackend(fast_sim(max_batch_size=1, decode_step_time=0.0005)))
    order: list[str] = []
    sink = Collector()

    def record(event: GenerationEvent) -> None:
        if event.request_id not in sink.events:
            order.append(event.request_id)
        sink(event)

    engine.submit(req("running", [1, 2], 20), record)
    await poll(lambda: sink.count("running") >= 1, what="the batch is full")
    for rid, priority in (("low", 1), ("unspecified", 0), ("high", 3), ("normal", 2)):
        engine.submit(req(rid, [3, 4], 2, priority=priority), record)
    await sink.wait("running", "low", "unspecified", "high", "normal")
    assert order == ["running", "high", "unspecified", "normal", "low"]


async def test_deadlines_end_running_and_queued_requests_with_deadline_exceeded(engine_of) -> None:
    backend = SimBackend(fast_sim(max_batch_size=1, decode_step_time=0.001))
    engine = await engine_of(backend)
    sink = Collector()
    soon = time.monotonic() + 0.05
    engine.submit(req("running", [1, 2], 100, deadline=soon), sink)
    engine.submit(req("queued", [5, 6, 7], 10, deadline=soon), sink)
    await sink.wait("running", "queued")
    for rid in ("running", "queued"):
        last = sink.last(rid)
        assert last.finish_reason is FinishReason.ERROR and last.error_reason == Reason.DEADLINE_EXCEEDED
    assert sink.count("queued") == 0 and backend.prompt_tokens_total == 2   # the queued one never ran
    assert engine.live == 0 and backend.load().kv_blocks_used == 0
    with pytest.raises(TokenrelayError) as late:
        engine.submit(req("late", [1], 2, deadline=time.monotonic() - 1), sink)
    assert late.value.reason == Reason.DEADLINE_EXCEEDED
    engine.submit(req("in-time", [1], 3, deadline=time.monotonic() + 60), sink)
    await sink.wait("in-time")
    assert sink.last("in-time").finish_reason is FinishReason.LENGTH


async def test_a_dead_sim_fails_everything_with_a_retryable_reason(engine_of) -> None:
    backend = SimBackend(fast_sim(die_after_steps=3, max_batch_size=1))
    engine = await engine_of(backend)
    changes: list[HealthState] = []
    engine.on_health_change(lambda: changes.append(engine.health))
    sub = engine.subscribe_kv_events()
    sink = Collector()
    engine.submit(req("running", [1, 2], 50), sink)
    engine.submit(req("queued", [3, 4], 50), sink)
    await sink.wait("running", "queued")
    for rid in ("running", "queued"):
        assert sink.last(rid).error_reason == Reason.ENGINE_UNAVAILABLE
    assert Reason.ENGINE_UNAVAILABLE.retryable
    assert engine.health is HealthState.DEAD and changes == [HealthState.DEAD] and engine.live == 0
    with pytest.raises(TokenrelayError) as refused:
        engine.submit(req("after", [1], 2), sink)
    assert refused.value.reason == Reason.ENGINE_UNAVAILABLE
    # The subscription ends (after what was buffered before the death) instead of waiting forever.
    assert sub.closed

    async def drain() -> list:
        return [batch async for batch in sub]

    leftover = await asyncio.wait_for(drain(), 5)
    assert all(e.type is KvEventType.STORED for events, _ in leftover for e in events)


class _Minimal(Backend):
    """A backend that implements only the required methods, and loses requests when it dies."""

    name = "minimal"

    def __init__(self) -> None:
        self.live: dict[str, object] = {}

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    def submit(self, request, sink) -> None:
        self.live[request.request_id] = sink

    def abort(self, request_id: str) -> bool:
        sink = self.live.pop(request_id, None)
        if sink is not None:
            sink(GenerationEvent.cancelled(request_id))
        return sink is not None

    def load(self) -> LoadSnapshot:
        return LoadSnapshot(self.name, "m", len(self.live), 0, 4, kv_blocks_total=10, kv_blocks_used=3)


async def test_defaults_for_a_backend_without_the_optional_parts(engine_of) -> None:
    backend = _Minimal()
    engine = await engine_of(backend)
    stats = engine.iteration_stats()
    assert (stats.kv_blocks_free, stats.kv_cache_hit_rate, engine.health) == (7, 0.0, HealthState.SERVING)
    assert not backend.emits_kv_events
    sink = Collector()
    engine.submit(req("lost", [1], 5), sink)
    # It dies without ending its request: the facade ends it, so nothing waits forever.
    backend._set_health(HealthState.DEAD, "gpu fell off the bus")
    await sink.wait("lost")
    last = sink.last("lost")
    assert last.error_reason == Reason.ENGINE_UNAVAILABLE and "gpu fell off" in last.error_message
    # The backend's late event for it goes nowhere.
    backend.live.pop("lost")(GenerationEvent("lost", [9], True, FinishReason.LENGTH))
    assert len(sink.events["lost"]) == 1


async def test_grpc_reports_death_on_the_stream_and_in_get_load(serve) -> None:
    stub, _ = await serve(sim_die_after_steps=20, sim_decode_step_time=0.001)
    client = StreamClient(stub)
    client.submit(engine_request("a", [1, 2, 3], 500), engine_request("b", [4, 5], 500))
    await client.wait("a", "b")
    for rid in ("a", "b"):
        assert client.last(rid).error_reason == Reason.ENGINE_UNAVAILABLE
    await client.ended()          # the stream ends by itself: a dead engine holds nothing
    assert client.loads[0].health == engine_pb2.ENGINE_HEALTH_SERVING and not client.loads[0].draining
    dead = client.loads[-1]
    assert dead.health == engine_pb2.ENGINE_HEALTH_DEAD and dead.draining   # older routers read `draining`
    load = await stub.GetLoad(engine_pb2.LoadRequest())
    assert load.health == engine_pb2.ENGINE_HEALTH_DEAD and load.draining
    second = StreamClient(stub)
    second.submit(engine_request("c", [1], 5))
    await second.wait("c")
    assert second.last("c").error_reason == Reason.ENGINE_UNAVAILABLE
    second.half_close()
    await second.ended()


async def test_grpc_load_report_carries_health_and_iteration_stats(serve) -> None:
    stub, _ = await serve()
    client = StreamClient(stub)
    client.submit(engine_request("a", list(range(1, 18)), 3))
    await client.wait("a")
    high = engine_request("b", list(range(1, 18)), 3)
    high.priority = common_pb2.PRIORITY_HIGH
    client.submit(high)
    await client.wait("b")
    assert client.chunks["b"][0].cached_tokens == 16
    load = await stub.GetLoad(engine_pb2.LoadRequest())
    assert load.health == engine_pb2.ENGINE_HEALTH_SERVING and not load.draining
    assert load.stats.kv_blocks_reused == 4 and load.stats.kv_cache_hit_rate == pytest.approx(0.5)
    assert load.stats.iteration > 0 and load.stats.kv_blocks_free == load.kv_blocks_total
    client.half_close()
    await client.ended()


async def test_grpc_deadline_travels_as_timeout_ms(serve) -> None:
    stub, _ = await serve(sim_decode_step_time=0.001)
    client = StreamClient(stub)
    request = engine_request("slow", [1, 2], 400)
    request.timeout_ms = 30
    client.submit(request)
    await client.wait("slow")
    assert client.last("slow").error_reason == Reason.DEADLINE_EXCEEDED
    assert 0 < len(client.tokens("slow")) < 400
    client.half_close()
    await client.ended()


async def test_subscribe_kv_events_over_grpc(serve) -> None:
    stub, engine = await serve()
    call = stub.SubscribeKvEvents(engine_pb2.KvEventsRequest())
    stream = aiter(call)
    first = await asyncio.wait_for(anext(stream), 5)
    assert first.info.enabled and first.info.tokens_per_block == 4 and first.info.backend == "sim"
    await poll(lambda: engine.backend.kv_event_hub.subscribers == 1, what="subscribed")
    client = StreamClient(stub)
    prompt = list(range(1, 9))
    client.submit(engine_request("a", prompt, 1))
    await client.wait("a")
    batch = await asyncio.wait_for(anext(stream), 5)
    stored = batch.events[0]
    assert stored.type == engine_pb2.KV_EVENT_STORED and not stored.HasField("parent_hash")
    assert [list(b.tokens) for b in stored.blocks] == [prompt[:4], prompt[4:]]
    assert [b.block_hash for b in stored.blocks] == engine.backend.kv.prompt_hashes(prompt, "")
    call.cancel()
    await poll(lambda: engine.backend.kv_event_hub.subscribers == 0, what="unsubscribed")
    client.half_close()
    await client.ended()


async def test_health_service_says_not_serving_when_the_engine_dies() -> None:
    from engine_svc.app import start_engine
    from engine_svc.config import EngineSettings
    from tests.engine.conftest import FAST

    engine, server = await start_engine(EngineSettings(**{**FAST, "sim_die_after_steps": 2}))
    channel = open_channel(server.address)
    try:
        health = health_pb2_grpc.HealthStub(channel)
        serving = await health.Check(health_pb2.HealthCheckRequest(service=""))
        assert serving.status == health_pb2.HealthCheckResponse.SERVING
        sink = Collector()
        engine.submit(req("x", [1, 2], 10), sink)
        await sink.wait("x")

        async def not_serving() -> bool:
            resp = await health.Check(health_pb2.HealthCheckRequest(service=""))
            return resp.status == health_pb2.HealthCheckResponse.NOT_SERVING

        await poll(not_serving, what="NOT_SERVING")
        engine_health = await health.Check(health_pb2.HealthCheckRequest(service="tokenrelay.v1.Engine"))
        assert engine_health.status == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        await channel.close()
        await server.stop(0)
        await engine.close()


async def test_subscribe_kv_events_of_a_backend_without_events_says_so_and_ends(engine_of) -> None:
    from engine_svc.app import SERVICE_NAME
    from engine_svc.servicer import EngineServicer
    from services.grpc_util import GrpcServer
    from services.proto.tokenrelay.v1 import engine_pb2_grpc

    engine = await engine_of(_Minimal())
    server = GrpcServer("127.0.0.1", 0, [SERVICE_NAME])
    engine_pb2_grpc.add_EngineServicer_to_server(EngineServicer(engine), server.server)
    await server.start()
    channel = open_channel(server.address)
    try:
        stub = engine_pb2_grpc.EngineStub(channel)
        messages = [m async for m in stub.SubscribeKvEvents(engine_pb2.KvEventsRequest(), timeout=10)]
        assert len(messages) == 1 and not messages[0].info.enabled and messages[0].info.backend == "minimal"
        load = await stub.GetLoad(engine_pb2.LoadRequest())
        assert load.health == engine_pb2.ENGINE_HEALTH_SERVING and load.stats.kv_blocks_free == 7
    finally:
        await channel.close()
        await server.stop(0)
