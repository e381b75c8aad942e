"""The Engine gRPC servicer: protobuf <-> domain conversion at this one edge, nothing else."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import grpc

from services.errors import TokenrelayError
from services.frames import FrameStream
from services.proto.tokenrelay.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from services.wire import FINISH_CODES

from .backends.base import FinishReason, GenerationRequest, LoadSnapshot
from .backends.events import HealthState, IterationStats, KvEvent, KvEventType
from .engine import Engine
from .outbox import Chunk
from .session import Inbound, StreamSession

_HEALTH = {HealthState.SERVING: engine_pb2.ENGINE_HEALTH_SERVING,
           HealthState.DRAINING: engine_pb2.ENGINE_HEALTH_DRAINING, HealthState.DEAD: engine_pb2.ENGINE_HEALTH_DEAD,
           HealthState.UNAVAILABLE: engine_pb2.ENGINE_HEALTH_UNAVAILABLE}
_KV_EVENT = {KvEventType.STORED: engine_pb2.KV_EVENT_STORED, KvEventType.REMOVED: engine_pb2.KV_EVENT_REMOVED,
             KvEventType.CREATED: engine_pb2.KV_EVENT_CREATED, KvEventType.UPDATED: engine_pb2.KV_EVENT_UPDATED}
_MASK64 = (1 << 64) - 1


def request_from_proto(r: engine_pb2.EngineRequest) -> GenerationRequest:
    s = r.sampling
    return GenerationRequest(
        request_id=r.request_id, prompt_token_ids=list(r.prompt_token_ids), max_tokens=s.max_tokens,
        temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
        seed=s.seed if s.HasField("seed") else None, stop_token_ids=list(s.stop_token_ids),
        eos_token_ids=list(r.eos_token_ids), ignore_eos=s.ignore_eos, cache_salt=r.cache_salt,
        trace_context=dict(r.trace_context), priority=int(r.priority),
        deadline=time.monotonic() + r.timeout_ms / 1000 if r.timeout_ms else None)


def _finish_code(reason: FinishReason | None) -> common_pb2.FinishReason:
    return FINISH_CODES[reason.value] if reason else common_pb2.FINISH_REASON_UNSPECIFIED


def chunk_to_proto(c: Chunk) -> engine_pb2.TokenChunk:
    return engine_pb2.TokenChunk(
        request_id=c.request_id, token_ids=c.token_ids, finished=c.finished,
        finish_reason=_finish_code(c.finish_reason), cached_tokens=c.cached_tokens,
        error_reason=c.error_reason, error_message=c.error_message)


def stats_to_proto(t: IterationStats) -> engine_pb2.IterationStats:
    return engine_pb2.IterationStats(
        iteration=t.iteration, active_requests=t.active, queued_requests=t.queued,
        kv_blocks_total=t.kv_blocks_total, kv_blocks_used=t.kv_blocks_used, kv_blocks_free=t.kv_blocks_free,
        kv_blocks_reused=t.kv_blocks_reused, kv_blocks_missed=t.kv_blocks_missed,
        kv_cache_hit_rate=t.kv_cache_hit_rate, context_requests=t.context_requests,
        generation_requests=t.generation_requests, paused_requests=t.paused_requests,
        iteration_latency_ms=t.iteration_latency_ms)


def load_to_proto(s: LoadSnapshot, draining: bool = False, health: HealthState | None = None,
                  stats: IterationStats | None = None) -> engine_pb2.LoadReport:
    health = health or (HealthState.DRAINING if draining else HealthState.SERVING)
    return engine_pb2.LoadReport(
        backend=s.backend, model=s.model, active_requests=s.active, queued_requests=s.queued,
        max_active_requests=s.max_active, kv_blocks_total=s.kv_blocks_total,
        kv_blocks_used=s.kv_blocks_used, tokens_per_block=s.tokens_per_block,
        max_context=s.max_context, prompt_tokens_total=s.prompt_tokens_total,
        cached_tokens_total=s.cached_tokens_total, generated_tokens_total=s.generated_tokens_total,
        draining=draining or health is not HealthState.SERVING, health=_HEALTH[health],
        stats=stats_to_proto(stats) if stats is not None else None)


def kv_event_to_proto(e: KvEvent) -> engine_pb2.KvCacheEvent:
    # Hashes are 64-bit on the wire; an engine's Python ints may be signed (C++ size_t via pybind is not).
    return engine_pb2.KvCacheEvent(
        event_id=e.event_id, type=_KV_EVENT[e.type], window_size=e.window_size,
        parent_hash=e.parent_hash & _MASK64 if e.parent_hash is not None else None,
        blocks=[engine_pb2.KvBlock(block_hash=b.block_hash & _MASK64, tokens=b.token_ids,
                                   cache_level=b.cache_level, priority=b.priority) for b in e.blocks],
        block_hashes=[h & _MASK64 for h in e.block_hashes],
        num_blocks_per_cache_level=e.num_blocks_per_cache_level, cache_salt=e.cache_salt)


class _Inbound:
    """A Stream's inbound side as `Inbound`s. A message that does not decode (the interceptor raises
    MALFORMED_MESSAGE while the session's reader task reads it) is kept here and closes the session,
    aborting its requests: the stream then ends with that error instead of a clean half-close."""

    def __init__(self, messages: AsyncIterator[engine_pb2.EngineInbound], session: StreamSession) -> None:
        self._messages = messages
        self._session = session
        self.error: TokenrelayError | None = None

    async def __aiter__(self) -> AsyncIterator[Inbound]:
        try:
            async for m in self._messages:
                yield Inbound([request_from_proto(r) for r in m.submit], list(m.abort))
        except TokenrelayError as exc:
            self.error = exc
            self._session.close()


def outbound_message(session: StreamSession, chunks: list[Chunk]) -> engine_pb2.EngineOutbound:
    """One message of a stream: its chunks, and the engine's load when a report is due."""
    message = engine_pb2.EngineOutbound(chunks=[chunk_to_proto(c) for c in chunks])
    report = session.take_load()
    if report is not None:
        message.load.CopyFrom(load_to_proto(*report))
    return message


async def serve_frames(engine: Engine, stream: FrameStream) -> None:
    """`Stream` on the engine's frame port (services/frames.py): the same session as the gRPC call.
    A connection lost is a cancelled call: the session closes at once, aborting its requests."""
    session = StreamSession(engine)

    async def messages() -> AsyncIterator[engine_pb2.EngineInbound]:
        async for m in stream.messages(engine_pb2.EngineInbound.FromString):
            yield m
        if stream.lost:
            session.close()

    inbound = _Inbound(messages(), session)
    try:
        async for chunks in session.run(aiter(inbound)):
            await stream.send(outbound_message(session, chunks))
    finally:
        session.close()
    if inbound.error is not None:
        raise inbound.error


class EngineServicer(engine_pb2_grpc.EngineServicer):
    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self.frame_port = 0      # the frame port, told in load polls (0 = none)

    async def Stream(self, request_iterator: AsyncIterator[engine_pb2.EngineInbound],
                     context: grpc.aio.ServicerContext) -> AsyncIterator[engine_pb2.EngineOutbound]:
        session = StreamSession(self._engine)
        # The RPC ending for any reason (client gone, deadline, server stop) aborts its requests,
        # even while this generator is parked in a write and never resumed.
        context.add_done_callback(lambda _ctx: session.close())
        inbound = _Inbound(request_iterator, session)
        async for chunks in session.run(aiter(inbound)):
            yield outbound_message(session, chunks)
        if inbound.error is not None:
            raise inbound.error

    async def Abort(self, request: engine_pb2.EngineAbortRequest,
                    context: grpc.aio.ServicerContext) -> engine_pb2.EngineAbortResponse:
        return engine_pb2.EngineAbortResponse(aborted=self._engine.abort(list(request.request_ids)))

    async def GetLoad(self, request: engine_pb2.LoadRequest,
                      context: grpc.aio.ServicerContext) -> engine_pb2.LoadReport:
        engine = self._engine
        health = engine.health
        report = load_to_proto(engine.load(), health is not HealthState.SERVING, health, engine.iteration_stats())
        report.frame_port = self.frame_port
        return report

    async def SubscribeKvEvents(self, request: engine_pb2.KvEventsRequest,
                                context: grpc.aio.ServicerContext) -> AsyncIterator[engine_pb2.KvEventBatch]:
        engine = self._engine
        load = engine.load()
        enabled = engine.backend.emits_kv_events and engine.health is HealthState.SERVING
        subscription = engine.subscribe_kv_events()
        context.add_done_callback(lambda _ctx: subscription.close())
        try:
            yield engine_pb2.KvEventBatch(info=engine_pb2.KvEventsInfo(
                backend=load.backend, model=load.model, enabled=enabled, tokens_per_block=load.tokens_per_block))
            if not enabled:
                return
            async for events, dropped in subscription:
                yield engine_pb2.KvEventBatch(events=[kv_event_to_proto(e) for e in events], dropped_events=dropped)
        finally:
            subscription.close()
