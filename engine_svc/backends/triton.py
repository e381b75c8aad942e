"""`triton`: a Triton Inference Server running TensorRT-LLM's backend, over `tritonclient.grpc.aio`.

The model must be decoupled (streaming). Each request is one ``stream_infer`` stream on the client's
one channel (HTTP/2 streams are cheap): the aio client drops the request id of an error response,
so on a shared stream a failure could not be told apart from its neighbours'; on its own stream it
belongs to its request. Each streamed response carries that step's new token ids.

- The end: the aio client cannot ask for Triton's empty final response (it refuses parameters
  beginning with ``triton_``), so the backend ends a request itself when it sees a stop id (the end
  id or a ``stop_words_list`` id: the token is emitted) or ``max_tokens`` tokens, and also on a
  response flagged ``triton_final_response`` where the server sends one. Then it half-closes the
  stream. A stream the server ends earlier fails the request with ENGINE_UNAVAILABLE (retryable).
- Stop and cancellation: `abort` emits CANCELLED at once and sends TensorRT-LLM's per-request stop
  (the same request id with ``stop`` true) on the request's stream, then half-closes it; a stream
  still open ``stop_timeout`` seconds later is cancelled (Triton cancels the request).
- Failures: an error response fails its request with ENGINE_ERROR; an UNAVAILABLE stream or a
  failed readiness probe ends every live request with ENGINE_UNAVAILABLE and marks the backend
  UNAVAILABLE (the service answers NOT_SERVING); the probe goes on, and once the model is ready again
  (with the same interface) the backend serves again, no restart of this process needed. Another
  interface, or no probe (`health_interval` 0), makes it DEAD (final).

tritonclient is imported when the backend starts (the `triton` extra).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc

from services.errors import Reason
from services.logging import get_logger

from .base import Backend, FinishReason, GenerationEvent, GenerationRequest, LoadSnapshot, Sink
from .events import HealthState
from .remote import TaskSet
from .triton_config import TritonConfig
from .triton_tensors import ModelInterface, TensorBuilder, response_tokens

log = get_logger(__name__)


class _Live:
    __slots__ = ("count", "done", "first", "outbox", "request", "sink", "stop", "task", "wire_id")

    def __init__(self, request: GenerationRequest, wire_id: str, sink: Sink, stop: frozenset[int]) -> None:
        self.request = request
        self.wire_id = wire_id
        self.sink = sink
        self.stop = stop   # every id that ends it inside the server: the end id and the stop words
        self.count = 0
        self.first = True
        self.done = False
        self.outbox: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        self.task: asyncio.Task[None] | None = None


class TritonBackend(Backend):
    name = "triton"

    def __init__(self, config: TritonConfig) -> None:
        self.config = config
        self.model = config.model or config.model_name
        self.max_context = config.max_context
        self.vocab_size = config.vocab_size
        self._client: Any = None
        self._tensors: TensorBuilder | None = None
        self._live: dict[str, _Live] = {}
        self._tasks = TaskSet()
        self._counter = 0
        self.prompt_tokens_total = 0
        self.generated_tokens_total = 0
        self._interface: ModelInterface | None = None
        self.recoveries = 0

    # -- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        import tritonclient.grpc as triton_grpc
        import tritonclient.grpc.aio as triton_aio
        from tritonclient.utils import InferenceServerException

        cfg = self.config
        self._client = triton_aio.InferenceServerClient(cfg.url)
        deadline = time.monotonic() + cfg.connect_timeout
        while True:
            with contextlib.suppress(InferenceServerException):
                if await self._client.is_model_ready(cfg.model_name):
                    break
            if time.monotonic() > deadline:
                await self._client.close()
                raise RuntimeError(f"triton: model {cfg.model_name!r} not ready at {cfg.url} "
                                   f"after {cfg.connect_timeout:g} s")
            await asyncio.sleep(0.2)   # retry period of a server still starting, not a synchronisation
        interface = ModelInterface.from_config(await self._client.get_model_config(cfg.model_name, as_json=True))
        self._interface = interface
        if not interface.decoupled:
            await self._client.close()
            raise RuntimeError(f"triton: model {cfg.model_name!r} is not decoupled: streaming needs "
                               "model_transaction_policy { decoupled: true }")
        self._tensors = TensorBuilder(cfg, interface, triton_grpc.InferInput, triton_grpc.InferRequestedOutput)
        if cfg.health_interval > 0:
            self._tasks.spawn(self._watch_health(), "triton-health")
        log.info("triton_ready", url=cfg.url, model_name=cfg.model_name, inputs=sorted(interface.inputs))

    async def close(self) -> None:
        for request_id in list(self._live):
            self.abort(request_id)
        await self._tasks.cancel_all()
        self.close_kv_events()
        if self._client is not None:
            await self._client.close()
            self._client = None

    # -- requests -----------------------------------------------------------------------------
    def submit(self, request: GenerationRequest, sink: Sink) -> None:
        tensors = self._tensors
        if self._health is not HealthState.SERVING or tensors is None:
            raise Reason.ENGINE_UNAVAILABLE.error(f"triton server unavailable: {self._health_detail}")
        tensors.check(request)
        self._counter += 1
        live = _Live(request, f"{request.request_id}#{self._counter}", sink, tensors.stop_ids(request))
        live.outbox.put_nowait(tensors.request(request, live.wire_id))
        self._live[request.request_id] = live
        self.prompt_tokens_total += len(request.prompt_token_ids)
        timeout = None if request.deadline is None else max(0.001, request.deadline - time.monotonic())
        live.task = self._tasks.spawn(self._run(live, timeout), f"triton-{live.wire_id}")

    def abort(self, request_id: str) -> bool:
        live = self._live.get(request_id)
        if live is None:
            return False
        self._finish(live, GenerationEvent.cancelled(request_id))
        if self._tensors is not None:
            live.outbox.put_nowait(self._tensors.request(live.request, live.wire_id, stop=True))
        live.outbox.put_nowait(None)
        if live.task is not None:
            self._tasks.spawn(self._reap(live.task), "triton-stop")
        return True

    async def _reap(self, task: asyncio.Task[None]) -> None:
        """Give a stopped request's stream ``stop_timeout`` seconds to close, then cancel it."""
        done, _ = await asyncio.wait({task}, timeout=self.config.stop_timeout)
        if not done:
            log.warning("triton_stop_timeout", task=task.get_name(), timeout=self.config.stop_timeout)
            task.cancel()   # cancelling the stream makes Triton cancel the request

    @staticmethod
    async def _items(live: _Live) -> AsyncIterator[dict[str, Any]]:
        while (item := await live.outbox.get()) is not None:
            yield item

    async def _run(self, live: _Live, timeout: float | None) -> None:
        stream = self._client.stream_infer(self._items(live), stream_timeout=timeout)
        try:
            async for result, error in stream:
                if live.done:
                    continue   # stopped: read until the server closes the stream
                if error is not None:
                    self._fail(live, Reason.ENGINE_ERROR, f"triton: {error.message()}")
                else:
                    self._tokens(live, *response_tokens(result))
                if live.done:
                    live.outbox.put_nowait(None)   # half-close: the server then ends the stream
            if not live.done:
                self._fail(live, Reason.ENGINE_UNAVAILABLE, "triton: the stream ended before the request finished")
        except grpc.aio.AioRpcError as e:
            if e.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
                self._fail(live, Reason.DEADLINE_EXCEEDED, "triton: the request's deadline passed")
            elif e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED) and not live.done:
                self._server_gone(f"triton {e.code().name}: {e.details()}")
            else:
                self._fail(live, Reason.ENGINE_ERROR, f"triton {e.code().name}: {e.details()}")
        finally:
            stream.cancel()   # a no-op once the server has closed the stream

    def _tokens(self, live: _Live, tokens: list[int], final: bool) -> None:
        request = live.request
        reason: FinishReason | None = None
        for i, token in enumerate(tokens):
            if token in live.stop:
                reason, tokens = FinishReason.STOP, tokens[:i + 1]
                break
            if live.count + i + 1 >= request.max_tokens:
                reason, tokens = FinishReason.LENGTH, tokens[:i + 1]
                break
        if reason is None and final:
            reason = FinishReason.LENGTH if live.count + len(tokens) >= request.max_tokens else FinishReason.STOP
        if not tokens and reason is None:
            return
        live.count += len(tokens)
        self.generated_tokens_total += len(tokens)
        event = GenerationEvent(request.request_id, tokens, reason is not None, reason)
        if reason is None:
            live.sink(event)
        else:
            self._finish(live, event)

    def _fail(self, live: _Live, reason: Reason, message: str) -> None:
        self._finish(live, GenerationEvent.failed(live.request.request_id, reason, message))

    def _finish(self, live: _Live, event: GenerationEvent) -> None:
        if live.done:
            return
        live.done = True
        if self._live.get(live.request.request_id) is live:
            del self._live[live.request.request_id]
        live.sink(event)

    # -- health -------------------------------------------------------------------------------
    def _server_gone(self, detail: str) -> None:
        """Triton is unreachable or the model is not ready: fail everything live (retryable), then
        UNAVAILABLE while the probe runs (it brings the backend back), else DEAD."""
        if self._health is not HealthState.SERVING:
            return
        log.warning("triton_server_gone", url=self.config.url, detail=detail, live=len(self._live))
        for live in list(self._live.values()):
            self._fail(live, Reason.ENGINE_UNAVAILABLE, detail)
            live.outbox.put_nowait(None)
            if live.task is not None:
                live.task.cancel()
        self._set_health(HealthState.UNAVAILABLE if self.config.health_interval > 0 else HealthState.DEAD, detail)

    async def _watch_health(self) -> None:
        from tritonclient.utils import InferenceServerException

        while self._health is not HealthState.DEAD:
            await asyncio.sleep(self.config.health_interval)   # the probe's period, not a synchronisation
            try:
                ready = await self._client.is_model_ready(self.config.model_name)
            except InferenceServerException as e:
                self._server_gone(f"triton readiness probe: {e.message()}")
                continue
            if not ready:
                self._server_gone(f"triton: model {self.config.model_name!r} is not ready")
            elif self._health is HealthState.UNAVAILABLE:
                await self._server_back()

    async def _server_back(self) -> None:
        """The model is ready again: serve again if its interface is the same, else DEAD."""
        from tritonclient.utils import InferenceServerException

        try:
            config = await self._client.get_model_config(self.config.model_name, as_json=True)
        except InferenceServerException as e:
            log.info("triton_not_back_yet", detail=e.message())
            return
        interface = ModelInterface.from_config(config)
        if interface != self._interface:
            self._set_health(HealthState.DEAD, f"triton: model {self.config.model_name!r} came back with "
                                               "another interface")
            return
        self.recoveries += 1
        log.info("triton_server_back", url=self.config.url, recoveries=self.recoveries)
        self._set_health(HealthState.SERVING)

    def load(self) -> LoadSnapshot:
        return LoadSnapshot(
            backend=self.name, model=self.model, active=len(self._live), queued=0,
            max_active=self.config.max_batch_size, max_context=self.max_context,
            prompt_tokens_total=self.prompt_tokens_total, generated_tokens_total=self.generated_tokens_total)
