"""A fake `tensorrt_llm` for the trtllm backend's tests, written only from the documented API
(``../shared/docs/trtllm-api.md``: TensorRT-LLM 1.2.1's LLM API), never from its code.

What it does as documented: `LLM(...)` refuses unknown kwargs (ValueError); `generate_async` is not
a coroutine, needs a running loop, asserts on an empty prompt, raises `RequestError` for a prompt
over ``max_num_tokens`` without chunked prefill, `ValueError` for ``end_id=None`` without a
tokenizer and `RuntimeError("LLM is shutting down")` after shutdown; a streaming `RequestOutput`
yields itself once per step with ``outputs[0].token_ids`` (cumulative), ``token_ids_diff``,
``finish_reason`` and ``cached_tokens``; `abort()` finishes it as 'cancelled'; stats items
(camelCase dicts, with ``enable_iter_perf_stats``) and KV events (with ``event_buffer_max_size``
> 0 and block reuse) queue up, and their async iterators stop after ``timeout`` with nothing
queued. Block reuse is by (salt, prefix) at ``tokens_per_block`` granularity.

Test hooks (not TensorRT-LLM API, prefixed ``_fake``): `_fake_fail(request_id, exc)` makes one
request's iteration raise; `_fake_kill(exc)` is a background failure: every active iteration
raises ``exc`` and the executor shuts down. Steps are paced by ``step_time`` (the fake GPU).
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from .executor import RequestError
from .llmapi import KvCacheConfig, SchedulerConfig

__all__ = ["LLM", "SamplingParams"]

_KWARGS = {"backend", "max_batch_size", "max_num_tokens", "max_seq_len", "enable_chunked_prefill", "kv_cache_config",
           "scheduler_config", "stream_interval", "enable_iter_perf_stats", "return_perf_metrics"}
instances: list[LLM] = []   # every LLM built, for tests to reach the one a backend made


@dataclass(kw_only=True)
class SamplingParams:
    max_tokens: int = 32
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    end_id: int | None = None
    pad_id: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int | None = None
    logprobs: int | None = None
    n: int = 1
    detokenize: bool = True
    stop: Any = None


@dataclass
class CompletionOutput:
    index: int = 0
    token_ids: list[int] = field(default_factory=list)
    token_ids_diff: list[int] = field(default_factory=list)
    finish_reason: str | None = None


class RequestOutput:
    def __init__(self, llm: LLM, request_id: int, prompt: list[int], params: SamplingParams, salt: str | None) -> None:
        self._llm = llm
        self.request_id = request_id
        self.prompt_token_ids = prompt
        self.params = params
        self.salt = salt
        self.outputs = [CompletionOutput()]
        self.finished = False
        self.cached_tokens = 0
        self.aborted = False
        self._steps: asyncio.Queue[BaseException | None] = asyncio.Queue()

    def abort(self) -> None:
        self.aborted = True
        self._llm._abort(self)

    def __aiter__(self) -> RequestOutput:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished and self._steps.empty():
            raise StopAsyncIteration
        item = await self._steps.get()
        if isinstance(item, BaseException):
            raise item
        return self


class LLM:
    def __init__(self, model: str, tokenizer: Any = None, skip_tokenizer_init: bool = False,
                 tensor_parallel_size: int = 1, dtype: str = "auto", **kwargs: Any) -> None:
        unknown = set(kwargs) - _KWARGS
        if unknown:
            raise ValueError(f"unknown LLM arguments: {sorted(unknown)}")
        self.model, self.skip_tokenizer_init = model, skip_tokenizer_init
        self.tensor_parallel_size = tensor_parallel_size
        self.kwargs = kwargs
        self.kv = kwargs.get("kv_cache_config") or KvCacheConfig()
        self.scheduler = kwargs.get("scheduler_config") or SchedulerConfig()
        self.max_num_tokens = kwargs.get("max_num_tokens") or 8192
        self.max_batch_size = kwargs.get("max_batch_size") or 2048
        self.step_time = 0.001
        self._ids = itertools.count()
        self._active: dict[int, RequestOutput] = {}
        self._blocks: set[tuple[str | None, tuple[int, ...]]] = set()
        self._stats: deque[dict[str, Any]] = deque(maxlen=1000)
        self._events: deque[dict[str, Any]] = deque(maxlen=max(1, self.kv.event_buffer_max_size))
        self._event_ids = itertools.count()
        self._iter = 0
        self._reused = self._missed = 0
        self._shutdown = False
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.aborted: list[int] = []
        self.seen: list[RequestOutput] = []
        instances.append(self)

    # -- requests -----------------------------------------------------------------------------
    def generate_async(self, inputs: Any, sampling_params: SamplingParams | None = None, *, streaming: bool = False,
                       cache_salt: str | None = None, **_: Any) -> RequestOutput:
        if self._shutdown:
            raise RuntimeError("LLM is shutting down")
        loop = self._loop = asyncio.get_running_loop()
        prompt = list(inputs["prompt_token_ids"] if isinstance(inputs, dict) else inputs)
        assert prompt, "empty prompt"
        params = sampling_params or SamplingParams()
        if params.end_id is None and self.skip_tokenizer_init:
            raise ValueError("end_id is required without a tokenizer")
        if params.stop and self.skip_tokenizer_init:
            raise RuntimeError("stop strings need a tokenizer")
        if len(prompt) > self.max_num_tokens and not self.kwargs.get("enable_chunked_prefill"):
            raise RequestError(f"prompt length {len(prompt)} exceeds max_num_tokens {self.max_num_tokens}")
        out = RequestOutput(self, next(self._ids), prompt, params, cache_salt)
        out.cached_tokens = self._reuse(prompt, cache_salt)
        self._active[out.request_id] = out
        self.seen.append(out)
        if self._task is None:
            self._task = loop.create_task(self._run())
        self._wake.set()
        return out

    def _reuse(self, prompt: list[int], salt: str | None) -> int:
        tpb = self.kv.tokens_per_block
        if not self.kv.enable_block_reuse:
            return 0
        cached, parent = 0, None
        new_blocks = []
        for start in range(0, len(prompt) - tpb + 1, tpb):
            key = (salt, tuple(prompt[:start + tpb]))
            if key in self._blocks and cached == start:
                cached += tpb
                self._reused += 1
            else:
                self._missed += 1
                self._blocks.add(key)
                new_blocks.append({"block_hash": hash(key), "tokens": [{"token_id": t, "token_extra_id": 0}
                                                                      for t in prompt[start:start + tpb]],
                                   "cache_level": 0, "priority": 35})
            if not new_blocks:
                parent = hash(key)
        if new_blocks and self.kv.event_buffer_max_size > 0:
            self._events.append({"event_id": next(self._event_ids), "window_size": 4096,
                                 "data": {"type": "stored", "parent_hash": parent, "blocks": new_blocks}})
        return cached

    def _abort(self, out: RequestOutput) -> None:
        self.aborted.append(out.request_id)
        if self._active.pop(out.request_id, None) is not None and not out.finished:
            out.finished = True
            out.outputs[0].finish_reason = "cancelled"
            out.outputs[0].token_ids_diff = []
            out._steps.put_nowait(None)

    # -- the fake executor --------------------------------------------------------------------
    async def _run(self) -> None:
        while not self._shutdown:
            if not self._active:
                self._wake.clear()
                await self._wake.wait()
                continue
            await asyncio.sleep(self.step_time)
            self._iter += 1
            for out in list(self._active.values()):
                self._step(out)
            self._record_stats()

    def _step(self, out: RequestOutput) -> None:
        c, p = out.outputs[0], out.params
        token = (sum(out.prompt_token_ids) + 7 * len(c.token_ids) + 1) % 1000
        c.token_ids = [*c.token_ids, token]
        c.token_ids_diff = [token]
        stops = {*(p.stop_token_ids or ()), *(() if p.ignore_eos else (p.end_id,))}
        if token in stops:
            c.finish_reason = "stop"
        elif len(c.token_ids) >= p.max_tokens:
            c.finish_reason = "length"
        if c.finish_reason is not None:
            out.finished = True
            del self._active[out.request_id]
        out._steps.put_nowait(None)

    def _record_stats(self) -> None:
        if not self.kwargs.get("enable_iter_perf_stats"):
            return
        used = sum(1 + len(o.prompt_token_ids) // self.kv.tokens_per_block for o in self._active.values())
        lookups = self._reused + self._missed
        self._stats.append({
            "iter": self._iter, "iterLatencyMS": self.step_time * 1e3, "numActiveRequests": len(self._active),
            "numQueuedRequests": 0, "maxNumActiveRequests": self.max_batch_size, "gpuMemUsage": 1 << 30,
            "kvCacheStats": {"maxNumBlocks": 1000, "freeNumBlocks": 1000 - used, "usedNumBlocks": used,
                             "tokensPerBlock": self.kv.tokens_per_block, "reusedBlocks": self._reused,
                             "missedBlocks": self._missed,
                             "cacheHitRate": self._reused / lookups if lookups else 0.0},
            "inflightBatchingStats": {"numScheduledRequests": len(self._active), "numContextRequests": 0,
                                      "numGenRequests": len(self._active), "numPausedRequests": 0,
                                      "numCtxTokens": 0}})

    # -- stats and events ---------------------------------------------------------------------
    async def _drain(self, queue: deque[dict[str, Any]], timeout: float) -> Any:
        while True:
            if queue:
                yield queue.popleft()
                continue
            waited = 0.0
            while not queue and waited < timeout:
                await asyncio.sleep(0.005)   # the fake's own wait for an item (its timeout), not a test's
                waited += 0.005
            if not queue:
                return

    def get_stats_async(self, timeout: float = 2) -> Any:
        return self._drain(self._stats, timeout)

    def get_kv_cache_events_async(self, timeout: float = 2) -> Any:
        return self._drain(self._events, timeout)

    def shutdown(self) -> None:
        """Blocking in TensorRT-LLM (it joins its workers), so callers may run it in a thread."""
        self._shutdown = True
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._wake.set)

    # -- test hooks ---------------------------------------------------------------------------
    def _fake_fail(self, request_id: int, exc: BaseException) -> None:
        out = self._active.pop(request_id)
        out._steps.put_nowait(exc)   # after the steps it already made: the failure comes next

    def _fake_kill(self, exc: BaseException) -> None:
        for out in list(self._active.values()):
            self._fake_fail(out.request_id, exc)
        self.shutdown()
