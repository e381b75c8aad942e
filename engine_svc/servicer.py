"""The Engine gRPC servicer: protobuf <-> domain conversion at this one edge, nothing else."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from services.proto.tokenrelay.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from services.wire import FINISH_CODES

from .backends.base import FinishReason, GenerationRequest, LoadSnapshot
from .engine import Engine
from .outbox import Chunk
from .session import Inbound, StreamSession


def request_from_proto(r: engine_pb2.EngineRequest) -> GenerationRequest:
    s = r.sampling
    return GenerationRequest(
        request_id=r.request_id, prompt_token_ids=list(r.prompt_token_ids), max_tokens=s.max_tokens,
        temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
        seed=s.seed if s.HasField("seed") else None, stop_token_ids=list(s.stop_token_ids),
        eos_token_ids=list(r.eos_token_ids), ignore_eos=s.ignore_eos, cache_salt=r.cache_salt,
        trace_context=dict(r.trace_context))


def _finish_code(reason: FinishReason | None) -> common_pb2.FinishReason:
    return FINISH_CODES[reason.value] if reason else common_pb2.FINISH_REASON_UNSPECIFIED


def chunk_to_proto(c: Chunk) -> engine_pb2.TokenChunk:
    return engine_pb2.TokenChunk(
        request_id=c.request_id, token_ids=c.token_ids, finished=c.finished,
        finish_reason=_finish_code(c.finish_reason), cached_tokens=c.cached_tokens,
        error_reason=c.error_reason, error_message=c.error_message)


def load_to_proto(s: LoadSnapshot, draining: bool = False) -> engine_pb2.LoadReport:
    return engine_pb2.LoadReport(
        backend=s.backend, model=s.model, active_requests=s.active, queued_requests=s.queued,
        max_active_requests=s.max_active, kv_blocks_total=s.kv_blocks_total,
        kv_blocks_used=s.kv_blocks_used, tokens_per_block=s.tokens_per_block,
        max_context=s.max_context, prompt_tokens_total=s.prompt_tokens_total,
        cached_tokens_total=s.cached_tokens_total, generated_tokens_total=s.generated_tokens_total,
        draining=draining)


async def _inbound(messages: AsyncIterator[engine_pb2.EngineInbound]) -> AsyncIterator[Inbound]:
    async for m in messages:
        yield Inbound([request_from_proto(r) for r in m.submit], list(m.abort))


class EngineServicer(engine_pb2_grpc.EngineServicer):
    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    async def Stream(self, request_iterator: AsyncIterator[engine_pb2.EngineInbound],
                     context: grpc.aio.ServicerContext) -> AsyncIterator[engine_pb2.EngineOutbound]:
        session = StreamSession(self._engine)
        # The RPC ending for any reason (client gone, deadline, server stop) aborts its requests,
        # even while this generator is parked in a write and never resumed.
        context.add_done_callback(lambda _ctx: session.close())
        async for chunks in session.run(_inbound(request_iterator)):
            message = engine_pb2.EngineOutbound(chunks=[chunk_to_proto(c) for c in chunks])
            report = session.take_load()
            if report is not None:
                message.load.CopyFrom(load_to_proto(*report))
            yield message

    async def Abort(self, request: engine_pb2.EngineAbortRequest,
                    context: grpc.aio.ServicerContext) -> engine_pb2.EngineAbortResponse:
        return engine_pb2.EngineAbortResponse(aborted=self._engine.abort(list(request.request_ids)))

    async def GetLoad(self, request: engine_pb2.LoadRequest,
                      context: grpc.aio.ServicerContext) -> engine_pb2.LoadReport:
        return load_to_proto(self._engine.load(), self._engine.draining)
