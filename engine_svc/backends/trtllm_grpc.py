"""`trtllm-grpc`: TensorRT-LLM reached over its own gRPC server (`trtllm-serve --grpc`, `TrtllmService`).

How NVIDIA's container is usually run: the engine lives in its own process (or pod) and this backend
is a client of it. Token ids in, delta token ids out, one server-streaming ``Generate`` call per
request on one channel; the messages are those of the published `smg-grpc-proto` package (see
`trtllm_grpc_wire`, the one place that touches them).

- Streaming: ``chunk`` responses carry new token ids; the ``complete`` response carries every output
  id and the finish reason, so whatever the chunks did not deliver is sent with the final event.
  Stop ids (EOS included unless ``ignore_eos``) travel as ``stop_token_ids`` with
  ``include_stop_token_in_output``: the contract emits the stop token.
- Abort: the final CANCELLED event is emitted at once; the call is cancelled (the server's servicer
  aborts the request on cancellation) and an ``Abort`` RPC is sent as well, in a task this backend owns.
- Failures: a call that fails mid-stream fails its request with the reason its status maps to; a
  status that says the server is gone (UNAVAILABLE, or CANCELLED by the server) — or a HealthCheck
  that fails or answers anything but "OK" — ends every live request with ENGINE_UNAVAILABLE
  (retryable: the router tries another replica) and marks the backend UNAVAILABLE, so the service
  reports NOT_SERVING instead of hanging. The health probe goes on; when the server answers "OK"
  again (and reports the same model) the backend serves again: a restarted `trtllm-serve` needs no
  restart of this process. A server back with another model, or no probe (`health_interval` 0),
  makes it DEAD (final: the process is restarted).
- KV events: one ``SubscribeKvEvents`` stream, resubscribed from the next sequence number when it
  breaks, mapped to the contract's events (`KvEventMapper`); the load record each batch carries
  feeds `iteration_stats()`. After the server was unavailable it is followed afresh from sequence 0
  (a restarted server numbers from the start and its cache is empty; the router's subscriptions
  were ended and it rebuilds the replica's entry).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import grpc

from services.channels import open_channel
from services.errors import Reason
from services.logging import get_logger

from .base import Backend, FinishReason, GenerationEvent, GenerationRequest, LoadSnapshot, Sink
from .events import HealthState, IterationStats
from .remote import TaskSet
from .trtllm_grpc_config import TrtllmGrpcConfig
from .trtllm_grpc_wire import KvEventMapper, Wire, finish_reason, status_reason

log = get_logger(__name__)


class _Live:
    __slots__ = ("done", "first", "request_id", "sent", "sink", "task", "wire_id")

    def __init__(self, request_id: str, wire_id: str, sink: Sink) -> None:
        self.request_id = request_id
        self.wire_id = wire_id
        self.sink = sink
        self.sent = 0
        self.first = True
        self.done = False
        self.task: asyncio.Task[None] | None = None


class TrtllmGrpcBackend(Backend):
    name = "trtllm-grpc"

    def __init__(self, config: TrtllmGrpcConfig, wire: Wire | None = None) -> None:
        self.config = config
        self.model = config.model
        self.emits_kv_events = config.kv_events
        self._wire = wire or Wire()
        self._channel: grpc.aio.Channel | None = None
        self._stub: Any = None
        self._live: dict[str, _Live] = {}
        self._tasks = TaskSet()
        self._counter = 0
        self._max_active = config.max_batch_size or 256
        self._load: Any = None   # the latest EngineLoad record of the KV event stream
        self._info: tuple[int, int] = (0, 0)          # (max_seq_len, vocab_size) the server reported
        self._back = asyncio.Event()                 # set each time the server serves again
        self.recoveries = 0
        self.prompt_tokens_total = 0
        self.cached_tokens_total = 0
        self.generated_tokens_total = 0

    # -- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        cfg = self.config
        self._channel = open_channel(cfg.address)
        self._stub = self._wire.stub(self._channel)
        try:
            info = await self._stub.GetModelInfo(self._wire.pb.GetModelInfoRequest(),
                                                 timeout=cfg.connect_timeout, wait_for_ready=True)
        except grpc.aio.AioRpcError as e:
            await self._channel.close()
            raise RuntimeError(f"trtllm-grpc: no TrtllmService at {cfg.address} "
                               f"({e.code().name}: {e.details()})") from e
        self.model = cfg.model or info.model_id.rstrip("/").rsplit("/", 1)[-1] or "trtllm"
        self.max_context = int(info.max_seq_len)
        self.vocab_size = int(info.vocab_size)
        self._info = (self.max_context, self.vocab_size)
        self._max_active = cfg.max_batch_size or int(info.max_batch_size) or 256
        if cfg.health_interval > 0:
            self._tasks.spawn(self._watch_health(), "trtllm-grpc-health")
        if cfg.kv_events:
            self._tasks.spawn(self._follow_kv_events(), "trtllm-grpc-kv-events")
        log.info("trtllm_grpc_ready", address=cfg.address, model=self.model, max_context=self.max_context,
                 vocab_size=self.vocab_size, max_batch_size=self._max_active)

    async def close(self) -> None:
        for request_id in list(self._live):
            self.abort(request_id)
        await self._tasks.cancel_all()
        self.close_kv_events()
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    # -- requests -----------------------------------------------------------------------------
    def submit(self, request: GenerationRequest, sink: Sink) -> None:
        if self._health is not HealthState.SERVING or self._stub is None:
            raise Reason.ENGINE_UNAVAILABLE.error(f"trtllm-grpc server unavailable: {self._health_detail}")
        self._counter += 1
        live = _Live(request.request_id, f"{request.request_id}#{self._counter}", sink)
        message = self._wire.generate_request(request, live.wire_id)
        timeout = None if request.deadline is None else max(0.001, request.deadline - time.monotonic())
        self._live[request.request_id] = live
        self.prompt_tokens_total += len(request.prompt_token_ids)
        live.task = self._tasks.spawn(self._run(live, message, timeout), f"trtllm-grpc-{live.wire_id}")

    def abort(self, request_id: str) -> bool:
        live = self._live.get(request_id)
        if live is None:
            return False
        self._finish(live, GenerationEvent.cancelled(request_id))
        if live.task is not None:
            live.task.cancel()
        if self._stub is not None and self._health is HealthState.SERVING:
            self._tasks.spawn(self._send_abort(live.wire_id), "trtllm-grpc-abort")
        return True

    async def _send_abort(self, wire_id: str) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError):
            await self._stub.Abort(self._wire.pb.AbortRequest(request_id=wire_id), timeout=self.config.health_timeout)

    async def _run(self, live: _Live, message: Any, timeout: float | None) -> None:
        try:
            async for response in self._stub.Generate(message, timeout=timeout):
                if live.done:
                    return
                kind = response.WhichOneof("response")
                if kind == "chunk":
                    self._chunk(live, list(response.chunk.token_ids), int(response.chunk.cached_tokens))
                elif kind == "complete":
                    self._complete(live, response.complete)
                    return
            self._finish(live, GenerationEvent.failed(live.request_id, Reason.ENGINE_ERROR,
                                                      "the Generate stream ended without a final response"))
        except grpc.aio.AioRpcError as e:
            if live.done:
                return
            reason, gone = status_reason(e.code())
            detail = f"trtllm-grpc {e.code().name}: {e.details()}"
            self._finish(live, GenerationEvent.failed(live.request_id, reason, detail))
            if gone:
                self._server_gone(detail)

    def _chunk(self, live: _Live, tokens: list[int], cached: int) -> None:
        if not tokens:
            return
        event = GenerationEvent(live.request_id, tokens)
        if live.first:
            live.first = False
            event.cached_tokens = cached
            self.cached_tokens_total += cached
        live.sent += len(tokens)
        self.generated_tokens_total += len(tokens)
        live.sink(event)

    def _complete(self, live: _Live, complete: Any) -> None:
        rest = list(complete.output_token_ids)[live.sent:]
        self.generated_tokens_total += len(rest)
        reason = finish_reason(complete.finish_reason)
        if reason is FinishReason.ERROR:
            event = GenerationEvent.failed(live.request_id, Reason.ENGINE_ERROR,
                                           f"the engine finished the request with {complete.finish_reason!r}", rest)
        else:
            event = GenerationEvent(live.request_id, rest, True, reason)
        if live.first:
            event.cached_tokens = int(complete.cached_tokens)
            self.cached_tokens_total += event.cached_tokens
        self._finish(live, event)

    def _finish(self, live: _Live, event: GenerationEvent) -> None:
        if live.done:
            return
        live.done = True
        if self._live.get(live.request_id) is live:
            del self._live[live.request_id]
        live.sink(event)

    # -- health -------------------------------------------------------------------------------
    def _server_gone(self, detail: str) -> None:
        """The server is unreachable or unhealthy: fail everything live (retryable), then
        UNAVAILABLE while the probe runs (it brings the backend back), else DEAD."""
        if self._health is not HealthState.SERVING:
            return
        log.warning("trtllm_grpc_server_gone", address=self.config.address, detail=detail, live=len(self._live))
        for live in list(self._live.values()):
            self._finish(live, GenerationEvent.failed(live.request_id, Reason.ENGINE_UNAVAILABLE, detail))
            if live.task is not None:
                live.task.cancel()
        self._back.clear()
        # Either also ends the KV event subscriptions.
        self._set_health(HealthState.UNAVAILABLE if self.config.health_interval > 0 else HealthState.DEAD, detail)

    async def _watch_health(self) -> None:
        request = self._wire.pb.HealthCheckRequest()
        while self._health is not HealthState.DEAD:
            await asyncio.sleep(self.config.health_interval)   # the probe's period, not a synchronisation
            try:
                reply = await self._stub.HealthCheck(request, timeout=self.config.health_timeout)
            except grpc.aio.AioRpcError as e:
                self._server_gone(f"trtllm-grpc HealthCheck {e.code().name}: {e.details()}")
                continue
            if reply.status != "OK":
                self._server_gone(f"trtllm-grpc HealthCheck: {reply.status}")
            elif self._health is HealthState.UNAVAILABLE:
                await self._server_back()

    async def _server_back(self) -> None:
        """The probe says OK again: serve again if it is the same model, else DEAD."""
        try:
            info = await self._stub.GetModelInfo(self._wire.pb.GetModelInfoRequest(),
                                                 timeout=self.config.health_timeout)
        except grpc.aio.AioRpcError as e:
            log.info("trtllm_grpc_not_back_yet", code=e.code().name, detail=e.details())
            return
        if (int(info.max_seq_len), int(info.vocab_size)) != self._info:
            self._set_health(HealthState.DEAD, f"the server came back with another model ({info.model_id!r}, "
                                               f"max_seq_len {info.max_seq_len}, vocab {info.vocab_size})")
            return
        self.recoveries += 1
        log.info("trtllm_grpc_server_back", address=self.config.address, recoveries=self.recoveries)
        self._set_health(HealthState.SERVING)
        self._back.set()

    # -- KV events and load -------------------------------------------------------------------
    async def _follow_kv_events(self) -> None:
        mapper, seen = KvEventMapper(), self.recoveries
        while self._health is not HealthState.DEAD:
            if self.recoveries != seen:          # a server back from unavailable: follow it afresh
                mapper, seen = KvEventMapper(), self.recoveries
            start = 0 if mapper.last_sequence is None else mapper.last_sequence + 1
            try:
                async for batch in self._stub.SubscribeKvEvents(self._wire.kv_subscribe_request(start)):
                    if batch.HasField("load"):
                        self._load = batch.load
                    self.publish_kv_events(mapper.batch(batch))
                # The server ended the stream: it publishes no more, unless it goes away and comes back.
                await self._back_again(seen)
                continue
            except grpc.aio.AioRpcError as e:
                if e.code() is grpc.StatusCode.UNIMPLEMENTED:
                    log.info("trtllm_grpc_no_kv_events", detail=e.details())
                    self.emits_kv_events = False
                    return
                if e.code() is not grpc.StatusCode.UNAVAILABLE:
                    log.warning("trtllm_grpc_kv_events_failed", code=e.code().name, detail=e.details())
                    return
                # UNAVAILABLE: a Generate call or the health probe decides whether the server is gone;
                # resubscribe once the channel is ready again (and, if it was gone, once it serves).
                if self._channel is None:
                    return
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._channel.channel_ready(), self.config.connect_timeout)
                if self._health is HealthState.UNAVAILABLE:
                    await self._back_again(seen)

    async def _back_again(self, seen: int) -> None:
        """Wait until the server has come back since recovery number `seen` (DEAD: never)."""
        while self.recoveries == seen and self._health is not HealthState.DEAD:
            if self._health is HealthState.SERVING:
                self._back.clear()
            await self._back.wait()

    def load(self) -> LoadSnapshot:
        active = len(self._live)
        queued = 0
        if self._load is not None:
            queued = int(self._load.waiting_requests)
        return LoadSnapshot(
            backend=self.name, model=self.model, active=active, queued=queued, max_active=self._max_active,
            max_context=self.max_context, prompt_tokens_total=self.prompt_tokens_total,
            cached_tokens_total=self.cached_tokens_total, generated_tokens_total=self.generated_tokens_total)

    def iteration_stats(self) -> IterationStats:
        """The server's own counts when its KV event stream reports them; else this client's."""
        record = self._load
        if record is None:
            return super().iteration_stats()
        hit = float(record.cache_hit_rate) if record.HasField("cache_hit_rate") else 0.0
        return IterationStats(
            iteration=int(record.sample), active=int(record.running_requests),
            queued=int(record.waiting_requests),
            max_active=int(record.max_running_requests) or self._max_active, kv_cache_hit_rate=hit,
            generation_requests=int(record.running_requests))
