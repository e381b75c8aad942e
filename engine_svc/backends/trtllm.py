"""`trtllm`: TensorRT-LLM in process, through its LLM API with the PyTorch backend.

Token ids in (``skip_tokenizer_init=True``): stop strings are the detokenizer's job, so the engine
only ever sees ids. Each request is ``llm.generate_async(prompt_ids, params, streaming=True,
cache_salt=...)`` consumed by one task that forwards every step's ``token_ids_diff``; the task's
``finally`` calls ``RequestOutput.abort()`` whenever the request did not finish, because cancelling
the asyncio task alone does not stop the request in the executor (its KV blocks would stay
held). ``end_id`` and the extra EOS ids come from the model's generation config; KV block reuse is
on, and a request's ``cache_salt`` (the router's per-tenant salt, when KV isolation is
configured) limits its prefix reuse to requests with the same salt.

One task the backend owns polls ``get_stats_async`` and ``get_kv_cache_events_async`` (each
stops after ``poll_timeout`` with nothing queued), keeps the latest `IterationStats` and publishes
the events to subscribers. TensorRT-LLM 1.2.1 takes no request priority: ``priority`` is ignored;
deadlines are enforced by the `Engine` facade (abort at the deadline).

Failures. A `RequestError` from a request's iteration fails that request (ENGINE_ERROR); the
others go on. Anything else from an iteration, a `RuntimeError` from ``generate_async`` ("LLM is
shutting down") or a failing poll means the executor is gone (TensorRT-LLM shuts its executor down
on background exceptions): the backend is DEAD, every live request is aborted and ends with the
retryable ENGINE_UNAVAILABLE, new submits are refused with it, and the service answers
NOT_SERVING. The process is not restarted from inside: its supervisor does that.

tensorrt_llm is imported in `start()` only, so a base install loads this module (the factory in
``__init__`` refuses ``--backend trtllm`` without it, in one line naming the extra).
"""

from __future__ import annotations

import asyncio
import importlib
import time
from dataclasses import dataclass
from typing import Any

from services.errors import Reason
from services.logging import get_logger
from services.tasks import OwnedTask

from .base import Backend, GenerationEvent, GenerationRequest, LoadSnapshot, PrefixCacheStats, Sink
from .events import HealthState, IterationStats
from .trtllm_config import TrtllmConfig, llm_kwargs
from .trtllm_map import finish_reason, kv_event_from_trtllm, model_eos_ids, sampling_kwargs, stats_from_trtllm

log = get_logger(__name__)

__all__ = ["TrtllmBackend", "TrtllmConfig"]

# How many items one poll takes from a source before turning to the other, so a busy stats stream
# (one item per iteration) never starves the KV events.
_POLL_BATCH = 256


@dataclass(slots=True)
class _Live:
    output: Any                          # RequestOutput
    sink: Sink
    task: asyncio.Task[None] | None = None


class TrtllmBackend(Backend):
    name = "trtllm"

    def __init__(self, config: TrtllmConfig) -> None:
        if not config.model:
            raise ValueError("the trtllm backend needs --model (a model directory)")
        self.config = config
        self.model = config.model
        self.emits_kv_events = config.event_buffer_size > 0
        self._llm: Any = None
        self._request_error: type[BaseException] = RuntimeError
        self._sampling_params: Any = None
        self._eos: list[int] = []
        self._end_id = config.end_id
        self._live: dict[str, _Live] = {}
        self._poller = OwnedTask("trtllm-stats-events")
        self._stats = IterationStats()
        self.prompt_tokens_total = 0
        self.cached_tokens_total = 0
        self.generated_tokens_total = 0

    # -- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        tllm = importlib.import_module("tensorrt_llm")
        llmapi = importlib.import_module("tensorrt_llm.llmapi")
        executor = importlib.import_module("tensorrt_llm.executor")
        self._request_error = getattr(executor, "RequestError", RuntimeError)
        self._sampling_params = tllm.SamplingParams
        self._eos = model_eos_ids(self.config.model)
        if self._end_id < 0:
            if not self._eos:
                raise ValueError(f"{self.config.model}: no eos_token_id in generation_config.json or config.json; "
                                 "pass --trtllm-end-id")
            self._end_id = self._eos[0]
        self._llm = tllm.LLM(**llm_kwargs(self.config, llmapi))
        self.max_context = self.config.max_seq_len or int(getattr(self._llm, "max_seq_len", 0) or 0)
        self._poller.ensure(self._poll)

    async def close(self) -> None:
        for rid in list(self._live):
            self.abort(rid)
        await self._poller.close()
        self.close_kv_events()
        if self._llm is not None:
            llm, self._llm = self._llm, None
            await asyncio.to_thread(llm.shutdown)

    # -- requests -----------------------------------------------------------------------------
    def validate(self, request: GenerationRequest) -> None:
        super().validate(request)
        n = len(request.prompt_token_ids)
        if not self.config.enable_chunked_prefill and n > self.config.max_num_tokens:
            raise Reason.PROMPT_TOO_LONG.error(f"prompt ({n} tokens) over max_num_tokens "
                                               f"({self.config.max_num_tokens}) without chunked prefill")

    def submit(self, request: GenerationRequest, sink: Sink) -> None:
        if self.health() is HealthState.DEAD or self._llm is None:
            raise Reason.ENGINE_UNAVAILABLE.error(f"the trtllm engine is not running: {self.health_detail}")
        params = self._sampling_params(**sampling_kwargs(request, self._eos, self._end_id))
        try:
            output = self._llm.generate_async(list(request.prompt_token_ids), params, streaming=True,
                                              cache_salt=request.cache_salt or None)
        except self._request_error as exc:
            raise Reason.ENGINE_ERROR.error(f"TensorRT-LLM refused the request: {exc}") from exc
        except ValueError as exc:
            raise Reason.INVALID_SAMPLING.error(f"TensorRT-LLM refused the request: {exc}") from exc
        except RuntimeError as exc:   # "LLM is shutting down": the executor is gone
            self._die(f"generate_async failed: {exc}")
            raise Reason.ENGINE_UNAVAILABLE.error(f"the trtllm engine is not running: {exc}") from exc
        live = self._live[request.request_id] = _Live(output, sink)
        live.task = asyncio.get_running_loop().create_task(self._consume(request, live),
                                                           name=f"trtllm-request-{request.request_id}")

    async def _consume(self, request: GenerationRequest, live: _Live) -> None:
        rid, output = request.request_id, live.output
        generated = 0
        done = False
        try:
            async for out in output:
                if self._live.get(rid) is not live:
                    return   # aborted meanwhile: abort() already ended it
                completion = out.outputs[0]
                new = list(completion.token_ids_diff)
                event = GenerationEvent(rid, new)
                if not generated and new:
                    event.cached_tokens = int(getattr(out, "cached_tokens", 0) or 0)
                    self.prompt_tokens_total += len(request.prompt_token_ids)
                    self.cached_tokens_total += event.cached_tokens
                generated += len(new)
                self.generated_tokens_total += len(new)
                if out.finished:
                    done = True
                    reason = finish_reason(completion.finish_reason, generated, request.max_tokens)
                    if reason is None:
                        event = GenerationEvent.failed(rid, Reason.DEADLINE_EXCEEDED, "TensorRT-LLM timed the "
                                                       "request out", new)
                    else:
                        event.finished, event.finish_reason = True, reason
                    self._end(rid, live, event)
                    return
                if new:
                    live.sink(event)
            done = True
            self._end(rid, live, GenerationEvent.failed(rid, Reason.ENGINE_ERROR, "TensorRT-LLM ended the stream "
                                                        "without a finished output"))
        except asyncio.CancelledError:
            raise
        except self._request_error as exc:
            self._end(rid, live, GenerationEvent.failed(rid, Reason.ENGINE_ERROR, f"TensorRT-LLM failed the "
                                                        f"request: {exc}"))
        except Exception as exc:  # noqa: BLE001 - not a per-request error: the executor died under it
            self._die(f"request {rid} failed: {exc!r}")
        finally:
            if not done:
                _abort_output(output)

    def _end(self, rid: str, live: _Live, event: GenerationEvent) -> None:
        if self._live.get(rid) is live:
            del self._live[rid]
            live.sink(event)

    def abort(self, request_id: str) -> bool:
        live = self._live.pop(request_id, None)
        if live is None:
            return False
        _abort_output(live.output)
        if live.task is not None:
            live.task.cancel()
        live.sink(GenerationEvent.cancelled(request_id))
        return True

    def _die(self, detail: str) -> None:
        if self.health() is HealthState.DEAD:
            return
        log.error("trtllm_engine_died", detail=detail, live=len(self._live))
        doomed, self._live = self._live, {}
        for rid, live in doomed.items():
            _abort_output(live.output)
            if live.task is not None and live.task is not asyncio.current_task():
                live.task.cancel()
            live.sink(GenerationEvent.failed(rid, Reason.ENGINE_UNAVAILABLE, f"TensorRT-LLM executor died: {detail}"))
        self._set_health(HealthState.DEAD, detail)

    # -- load, stats and events ---------------------------------------------------------------
    def load(self) -> LoadSnapshot:
        s = self._stats
        active = min(s.active, len(self._live))
        return LoadSnapshot(
            backend=self.name, model=self.model, active=active, queued=len(self._live) - active,
            max_active=self.config.max_batch_size, kv_blocks_total=s.kv_blocks_total, kv_blocks_used=s.kv_blocks_used,
            tokens_per_block=s.tokens_per_block or self.config.tokens_per_block, max_context=self.max_context,
            prompt_tokens_total=self.prompt_tokens_total, cached_tokens_total=self.cached_tokens_total,
            generated_tokens_total=self.generated_tokens_total)

    def iteration_stats(self) -> IterationStats:
        return self._stats

    def prefix_cache_stats(self) -> PrefixCacheStats:
        s = self._stats
        return PrefixCacheStats(s.kv_blocks_reused, s.kv_blocks_missed, 0, 0)

    async def _poll(self) -> None:
        """The one task reading the engine's stats and KV events."""
        timeout = self.config.poll_timeout
        while self.health() is not HealthState.DEAD:
            started = time.monotonic()
            try:
                got = await self._take_stats(timeout)
                if self.emits_kv_events:
                    got += await self._take_events(timeout)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - a failing poll: the executor is gone
                self._die(f"polling stats / KV events failed: {exc!r}")
                return
            idle = timeout - (time.monotonic() - started)
            if not got and idle > 0:
                await asyncio.sleep(idle)   # pacing: an engine that answers "nothing" at once

    async def _take_stats(self, timeout: float) -> int:
        n = 0
        async for item in self._llm.get_stats_async(timeout=timeout):
            self._stats = stats_from_trtllm(item)
            n += 1
            if n >= _POLL_BATCH:
                break
        return n

    async def _take_events(self, timeout: float) -> int:
        events = []
        async for item in self._llm.get_kv_cache_events_async(timeout=timeout):
            event = kv_event_from_trtllm(item)
            if event is not None:
                events.append(event)
            if len(events) >= _POLL_BATCH:
                break
        self.publish_kv_events(events)
        return len(events)


def _abort_output(output: Any) -> None:
    try:
        output.abort()
    except Exception as exc:  # noqa: BLE001 - aborting a finished or dead request: nothing to free
        log.debug("trtllm_abort_failed", error=repr(exc))
