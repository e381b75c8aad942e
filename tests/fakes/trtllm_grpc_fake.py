"""A fake `trtllm-serve --grpc`: a real grpc.aio server implementing `TrtllmService` from `smg-grpc-proto`.

It behaves the way TensorRT-LLM's servicer does where the backend depends on it: ``chunk`` responses
with delta token ids, then a ``complete`` response with every output id and the finish reason (the
last token is in both); stop ids end a request (the stop token included when asked); ``Abort`` or a
cancelled call ends the request with finish reason ``cancelled``; failures are gRPC statuses.

Token k of a request is ``(prompt[-1] + k + 1) % VOCAB``, so a test can place a stop id on the path.
A prompt starting with ``ERROR_AFTER_2`` fails with INTERNAL after two tokens. ``step`` paces tokens
like an engine step (the fake engine's speed, not a synchronisation). KV event batches are whatever
a test puts into ``kv_batches``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
from smg_grpc_proto.generated import common_pb2, trtllm_service_pb2, trtllm_service_pb2_grpc

from services.channels import bind_port

VOCAB = 1000
ERROR_AFTER_2 = 999


class FakeTrtllmService(trtllm_service_pb2_grpc.TrtllmServiceServicer):
    def __init__(self, step: float = 0.0) -> None:
        self.pb, self.pb_grpc, self.common = trtllm_service_pb2, trtllm_service_pb2_grpc, common_pb2
        self.step = step
        self.health_status = "OK"
        self.max_seq_len = 4096          # GetModelInfo's (another value: "another model")
        self.requests: list[Any] = []
        self.aborts: list[str] = []
        self.cancelled: list[str] = []
        self.live: dict[str, asyncio.Event] = {}
        self.kv_batches: asyncio.Queue[Any] = asyncio.Queue()
        self.kv_subscriptions: list[int] = []
        self.kv_unimplemented = False

    # -- TrtllmService ------------------------------------------------------------------------
    async def Generate(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        pb = self.pb
        self.requests.append(request)
        rid = request.request_id
        prompt = list(request.tokenized.input_token_ids)
        stop_ids = set(request.stop_token_ids)
        aborted = self.live[rid] = asyncio.Event()
        out: list[int] = []
        reason = "length"
        try:
            for k in range(request.max_tokens):
                if prompt[0] == ERROR_AFTER_2 and k == 2:
                    await context.abort(grpc.StatusCode.INTERNAL, "fake engine failure mid-stream")
                if self.step:
                    await asyncio.sleep(self.step)
                if aborted.is_set():
                    reason = "cancelled"
                    break
                token = (prompt[-1] + k + 1) % VOCAB
                stopped = token in stop_ids
                if stopped and not request.include_stop_token_in_output:
                    reason = "stop"
                    break
                out.append(token)
                yield pb.GenerateResponse(request_id=rid, chunk=pb.GenerateStreamChunk(
                    token_ids=[token], prompt_tokens=len(prompt), completion_tokens=len(out),
                    cached_tokens=len(prompt) // 2))
                if stopped:
                    reason = "stop"
                    break
            yield pb.GenerateResponse(request_id=rid, complete=pb.GenerateComplete(
                output_token_ids=out, finish_reason=reason, prompt_tokens=len(prompt),
                completion_tokens=len(out), cached_tokens=len(prompt) // 2))
        except asyncio.CancelledError:
            self.cancelled.append(rid)
            raise
        finally:
            self.live.pop(rid, None)

    async def Abort(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        self.aborts.append(request.request_id)
        event = self.live.get(request.request_id)
        if event is not None:
            event.set()
        return self.pb.AbortResponse(success=event is not None)

    async def HealthCheck(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return self.pb.HealthCheckResponse(status=self.health_status)

    async def GetModelInfo(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return self.pb.GetModelInfoResponse(model_id="/models/fake-llama-8b", max_input_len=2048,
                                            max_seq_len=self.max_seq_len, max_batch_size=8, vocab_size=VOCAB)

    async def SubscribeKvEvents(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        if self.kv_unimplemented:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "KV cache events not enabled")
        self.kv_subscriptions.append(int(request.start_sequence_number))
        while True:
            batch = await self.kv_batches.get()
            if batch is None:
                return
            yield batch

    # -- helpers for tests --------------------------------------------------------------------
    def stored(self, seq: int, parent: int | None, *blocks: tuple[int, list[int]], load: Any = None) -> Any:
        c = self.common
        stored = c.KvBlocksStored(blocks=[c.KvBlock(block_hash=h, token_ids=t, block_size=len(t))
                                          for h, t in blocks])
        if parent is not None:
            stored.parent_block_hash = parent
        batch = c.KvEventBatch(sequence_number=seq, events=[c.KvCacheEvent(event_id=seq, stored=stored)])
        if load is not None:
            batch.load.CopyFrom(load)
        return batch

    def removed(self, seq: int, *hashes: int) -> Any:
        c = self.common
        return c.KvEventBatch(sequence_number=seq, events=[
            c.KvCacheEvent(event_id=seq, removed=c.KvBlocksRemoved(block_hashes=list(hashes)))])

    def cleared(self, seq: int) -> Any:
        c = self.common
        return c.KvEventBatch(sequence_number=seq, events=[c.KvCacheEvent(event_id=seq, cleared=c.KvCacheCleared())])


async def start_fake(service: FakeTrtllmService, port: int = 0) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    service.pb_grpc.add_TrtllmServiceServicer_to_server(service, server)
    bound = bind_port(server, f"127.0.0.1:{port}")
    await server.start()
    return server, f"127.0.0.1:{bound}"
