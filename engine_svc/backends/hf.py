"""`hf`: a real model with Hugging Face transformers continuous batching (CPU or one GPU).

One persistent `ContinuousBatchingManager` runs the model in its own thread; its outputs come back
on the event loop through `register_result_handler` (``call_soon_threadsafe``). Facts of
transformers 5.24.0 this module is built around:

- Sampling is decided per manager (``do_sample``). With ``per_request_processors=True`` the
  temperature / top-k / top-p warpers take per-request values, but only warpers that exist in the
  manager's GenerationConfig. With sampling on, every warper is created and a greedy request is
  sent as top_k=1 (the multinomial draw then has one candidate: argmax, matching
  ``generate(do_sample=False)``); `hf_sampling` swaps in warpers that only pay for what a row asks.
  transformers draws the batch from one RNG; `hf_seeds` gives a seeded request its own
  generator where the step runs eagerly (CPU); where it cannot (CUDA graphs, torch.compile) a
  seeded sampled request is rejected with UNSUPPORTED_SAMPLING rather than silently made
  irreproducible. With sampling off (``--no-hf-sampling``) any temperature > 0 is rejected.
- Prefill is chunked (``max_batch_tokens`` a step) and `hf_scheduler` orders it so that short
  prompts never wait behind a long one (scheduler ``short_first``; ``fifo`` is transformers').
- KV sizing is explicit (``num_blocks`` x ``block_size``, allocated at start, never inferred from
  free memory); the engine's context is the longest request that KV cache holds, so a prompt
  that could never fit is refused (CONTEXT_LENGTH_EXCEEDED) instead of stopping the generation
  thread for everyone (transformers raises "No requests can be scheduled" and dies).
- `cancel_request` never produces a terminal output, so `abort` ends the request itself (in any
  phase: queued, mid-prefill, mid-decode) and drops the result handler the manager would
  otherwise keep forever; the manager frees its KV blocks on its next step.
- No processor of the model's own generation_config (repetition penalty, ...) is applied; EOS ids
  come from the request, or from the model when the request names none.
- Prefix cache: transformers shares complete KV blocks between prompts with a common prefix when
  every layer allows it (not with sliding-window layers, e.g. Gemma 3). With ``short_first`` the
  matched tokens are reported per request (``cached_tokens`` on its first event) and as
  `prefix_cache_stats()`; with ``fifo``, or a model that cannot share blocks, ``cached_tokens``
  is 0 and `prefix_cache_stats()` is None: nothing is counted, and nothing pretends to be.
- The manager steps in its own thread, out of sight: this backend reports no per-step timings
  (`step_observer` stays unused). Its prefill and decode cost show in the engine's per-request
  metrics instead — time to first token and time per output token as seen by the result
  callbacks on the event loop (see engine_svc/metrics.py).

torch and transformers are imported only when the backend starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import threading
from typing import Any, Literal

from pydantic import Field

from services.config import Section, flag
from services.errors import Reason
from services.logging import get_logger

from .base import (
    Backend,
    FinishReason,
    GenerationEvent,
    GenerationRequest,
    LoadSnapshot,
    PrefixCacheStats,
    Sink,
)
from .events import HealthState
from .hf_internals import emulated_half_precision, eos_ids, kv_tokens, manager_load

log = get_logger(__name__)

_FAILED = 4  # transformers RequestStatus.FAILED
_HARD_STOP = 2  # transformers BackgroundThreadStatus.HARD_STOP (STOPPED = 3 is above it)


class HfConfig(Section):
    """The transformers continuous-batching engine: device, precision and batch limits."""

    model: str = Field("", description="model directory (config.json + safetensors)",
                       json_schema_extra=flag(None))   # set by the engine's --model
    device: str = Field("cpu", min_length=1, description="torch device (cpu, cuda, cuda:1, ...)")
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = Field(
        "float32", description="weights' dtype (auto = the checkpoint's, except that a bf16/fp16 checkpoint "
                               "runs in float32 on a CPU without native bf16/fp16 support, where half "
                               "precision is emulated: 3.4x slower measured on an AVX2 CPU)")
    threads: int = Field(0, ge=0, description="torch.set_num_threads (0 = torch's default)")
    num_blocks: int = Field(256, ge=1, description="KV cache size in blocks of block_size tokens of every layer "
                                                   "(allocated at start: the engine never sizes it from free memory); "
                                                   "the engine's context is what one request can hold in it")
    block_size: int = Field(32, ge=1, description="tokens per KV block (page)")
    max_batch_tokens: int = Field(256, ge=1, description="tokens per forward pass: the prefill chunk, which bounds "
                                                         "one step's time and so a short request's wait behind a "
                                                         "long prompt (256 suits a CPU; on a GPU use thousands)")
    max_batch_size: int = Field(32, ge=1, description="requests per forward pass")
    scheduler: Literal["short_first", "fifo"] = Field(
        "short_first", description="prefill order: short_first = shortest remaining prompt first, each prompt "
                                   "at most prefill_chunk_tokens a step; fifo = transformers' own (a long "
                                   "prefill holds up every prompt behind it)")
    prefill_chunk_tokens: int = Field(0, ge=0, description="most tokens of one prompt per step (short_first; "
                                                           "0 = max_batch_tokens)")
    sampling: bool = Field(True, description="allow temperature > 0 (per-request temperature, top_p, top_k); "
                                             "off = a greedy-only engine")
    random_weights: bool = Field(False, description="build the model from config.json with random weights "
                                                    "(capacity tests of a model shape; outputs are noise)")


class _HfRequest:
    __slots__ = ("done", "internal_id", "request_id", "sent", "sink", "started", "stop")

    def __init__(self, request_id: str, internal_id: str, sink: Sink, stop: frozenset[int]) -> None:
        self.request_id = request_id
        self.internal_id = internal_id
        self.sink = sink
        self.stop = stop
        self.sent = 0
        self.started = False
        self.done = False


class HfBackend(Backend):
    name = "hf"

    def __init__(self, config: HfConfig) -> None:
        self.config = config
        self.model = os.path.basename(os.path.normpath(config.model)) if config.model else ""
        self._manager: Any = None
        self._model_eos: tuple[int, ...] = ()
        self._requests: dict[str, _HfRequest] = {}
        self._scheduler: Any = None   # hf_scheduler.ShortFirstScheduler when scheduler=short_first
        self._seeds: dict[str, int] | None = None   # hf_seeds.SeededSampler.seeds where seeds work
        self._counter = 0
        self.kv_tokens = 0
        self.prompt_tokens_total = 0
        self.cached_tokens_total = 0
        self.generated_tokens_total = 0

    # -- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        # Loading takes seconds to minutes: keep it off the event loop.
        await asyncio.to_thread(self._load)
        self._watch(asyncio.get_running_loop())
        log.info("hf_engine_ready", model=self.config.model, device=self.config.device,
                 max_context=self.max_context, kv_tokens=self.kv_tokens, vocab_size=self.vocab_size,
                 sampling=self.config.sampling, scheduler=self.config.scheduler)

    def _load(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        cfg = self.config
        if cfg.threads > 0:
            torch.set_num_threads(cfg.threads)
        dtype = cfg.dtype if cfg.dtype == "auto" else getattr(torch, cfg.dtype)
        if cfg.random_weights:
            # Capacity tests of a model shape without its weights (config.json only).
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(cfg.model)
            torch.manual_seed(0)
            with torch.device(cfg.device):  # initialise where it will run (an 8B init on a CPU takes minutes)
                model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
        else:
            model = AutoModelForCausalLM.from_pretrained(cfg.model, attn_implementation="sdpa", dtype=dtype)
        model = model.to(torch.device(cfg.device)).eval()  # type: ignore[arg-type]
        if cfg.dtype == "auto" and emulated_half_precision(model, torch):
            model = model.float()
        text_config = model.config.get_text_config()
        self.vocab_size = int(text_config.vocab_size)
        self._model_eos = eos_ids(model)
        manager = model.init_continuous_batching(
            generation_config=self._generation_config(), continuous_batching_config=self._cb_config())
        if cfg.sampling:
            from .hf_sampling import install_fast_warpers

            install_fast_warpers(manager)
        # Builds the KV cache and the scheduler here rather than in the generation thread, so their
        # sizes are known before the first request (no CUDA graph is captured on CPU).
        manager.warmup()
        processor = manager.batch_processor
        self.kv_tokens = kv_tokens(processor.cache, cfg.num_blocks * cfg.block_size)
        # A request longer than the KV cache can hold would stop the generation thread for every
        # request ("No requests can be scheduled"): it is refused as beyond the context instead.
        self.max_context = min(int(text_config.max_position_embeddings), self.kv_tokens)
        if cfg.scheduler == "short_first":
            self._scheduler = processor.scheduler
        if cfg.sampling:
            from .hf_seeds import SeededSampler

            sampler = SeededSampler(processor.model_runner)
            if sampler.install():
                self._seeds = sampler.seeds
        manager.start()
        self._manager = manager

    def _watch(self, loop: asyncio.AbstractEventLoop) -> None:
        """transformers ends its generation thread on any error in a step (it fails the live
        requests and refuses new ones, silently): a thread that waits for it to end tells the loop."""
        manager = self._manager
        thread = getattr(manager, "_generation_thread", None)
        if thread is None:
            return

        def wait() -> None:
            thread.join()
            with contextlib.suppress(RuntimeError):   # the loop closed first: the process is exiting
                loop.call_soon_threadsafe(self._generation_thread_ended, manager)

        threading.Thread(target=wait, name="hf-generation-watch", daemon=True).start()

    def _generation_thread_ended(self, manager: Any) -> None:
        if manager is not self._manager:
            return   # close() stopped it
        error = getattr(manager.background_thread_status, "fatal_error", None)
        detail = f"the hf generation thread stopped: {error or 'no error recorded'}"
        log.error("hf_engine_dead", error=str(error))
        for req in list(self._requests.values()):
            self._end(req)
            req.sink(GenerationEvent.failed(req.request_id, Reason.ENGINE_UNAVAILABLE, detail))
        self._set_health(HealthState.DEAD, detail)

    def _generation_config(self) -> Any:
        from transformers import GenerationConfig

        if not self.config.sampling:
            return GenerationConfig(do_sample=False, eos_token_id=-1)
        # Values that make transformers create every warper; each request passes its own values.
        return GenerationConfig(do_sample=True, temperature=0.5, top_k=self.vocab_size, top_p=0.5,
                                eos_token_id=-1)

    def _cb_config(self) -> Any:
        from transformers import ContinuousBatchingConfig

        cfg = self.config
        scheduler = "fifo"
        if cfg.scheduler == "short_first":
            from .hf_scheduler import configure

            scheduler = configure(cfg.prefill_chunk_tokens or cfg.max_batch_tokens)
        return ContinuousBatchingConfig(
            num_blocks=cfg.num_blocks, max_batch_tokens=cfg.max_batch_tokens, page_size=cfg.block_size,
            max_requests_per_batch=cfg.max_batch_size, per_request_processors=cfg.sampling,
            auto_switch_to_flash=False, scheduler_type=scheduler)

    async def close(self) -> None:
        for request_id in list(self._requests):
            self.abort(request_id)
        manager, self._manager = self._manager, None
        if manager is not None:
            await asyncio.to_thread(manager.stop, block=True, timeout=30)

    # -- requests -----------------------------------------------------------------------------
    def _sampling_kwargs(self, request: GenerationRequest) -> dict[str, Any]:
        # Below 1e-5 the division by the temperature can overflow to inf, and a NaN in one row
        # would crash the manager's thread for every request: treat it as greedy, as vLLM does.
        if request.temperature < 1e-5:
            if not self.config.sampling:
                return {}
            return {"temperature": 1.0, "top_k": 1, "top_p": 1.0}
        if not self.config.sampling:
            raise Reason.UNSUPPORTED_SAMPLING.error("this engine runs greedy decoding only (temperature 0)")
        if request.seed is not None and self._seeds is None:
            raise Reason.UNSUPPORTED_SAMPLING.error("per-request seeds are not supported by this hf engine "
                                                    "(its step is captured: CUDA graphs or torch.compile)")
        return {"temperature": float(request.temperature),
                "top_k": int(request.top_k or self.vocab_size),
                "top_p": float(request.top_p or 1.0)}

    def submit(self, request: GenerationRequest, sink: Sink) -> None:
        manager = self._manager
        if manager is None or self.health() is HealthState.DEAD:
            raise Reason.ENGINE_UNAVAILABLE.error(f"the hf engine is not running {self.health_detail}".strip())
        kwargs = self._sampling_kwargs(request)
        eos = () if request.ignore_eos else (request.eos_token_ids or self._model_eos)
        stop = frozenset((*request.stop_token_ids, *eos))
        self._counter += 1
        # Internal ids never repeat: a cancelled id may linger in the manager for a step.
        req = _HfRequest(request.request_id, f"{self._counter}:{request.request_id}", sink, stop)
        manager.register_result_handler(req.internal_id, functools.partial(self._on_output, req))
        if request.seed is not None and request.temperature >= 1e-5 and self._seeds is not None:
            self._seeds[req.internal_id] = int(request.seed)
        added = manager.add_request(list(request.prompt_token_ids), request_id=req.internal_id,
                                    max_new_tokens=request.max_tokens, streaming=True,
                                    eos_token_id=sorted(stop), **kwargs)
        if added is None:
            self._end(req)
            raise Reason.ENGINE_UNAVAILABLE.error("the hf engine is not accepting requests (stopping or failed)")
        self._requests[request.request_id] = req
        self.prompt_tokens_total += len(request.prompt_token_ids)

    def _on_output(self, req: _HfRequest, output: Any) -> None:
        if req.done:
            return  # aborted: late outputs of a cancelled request are dropped
        tokens = output.generated_tokens
        new = list(tokens[req.sent:])
        req.sent = len(tokens)
        self.generated_tokens_total += len(new)
        if output.status == _FAILED:
            # Failed because the generation thread is dying (it stops hard, then fails everything):
            # another replica can run it. Otherwise this request's own step failed.
            dying = getattr(getattr(self._manager, "background_thread_status", None), "local_status", 0) >= _HARD_STOP
            event = GenerationEvent.failed(req.request_id, Reason.ENGINE_UNAVAILABLE if dying else Reason.ENGINE_ERROR,
                                           f"generation failed: {output.error}", new)
        elif output.is_finished():
            stopped = bool(tokens) and tokens[-1] in req.stop
            event = GenerationEvent(req.request_id, new, True,
                                    FinishReason.STOP if stopped else FinishReason.LENGTH)
        elif new:
            event = GenerationEvent(req.request_id, new)
        else:
            return
        if not req.started:  # the prompt's cache hit travels on the request's first event
            req.started = True
            event.cached_tokens = self._take_cached_tokens(req.internal_id)
        if event.finished:
            self._end(req)
        req.sink(event)

    def _take_cached_tokens(self, internal_id: str) -> int:
        if self._scheduler is None:
            return 0
        cached = int(self._scheduler.cached_tokens.pop(internal_id, 0))
        self.cached_tokens_total += cached
        return cached

    def prefix_cache_stats(self) -> PrefixCacheStats | None:
        """transformers' own prefix sharing, counted by the short_first scheduler; None with the fifo
        scheduler (not counted) or a model whose layers cannot share blocks (sliding-window layers,
        e.g. Gemma 3: nothing is cached, so every request reports 0 cached tokens)."""
        scheduler = self._scheduler
        if scheduler is None or not scheduler.cache.use_prefix_sharing:
            return None
        counters = scheduler.counters
        return PrefixCacheStats(hit_blocks=counters.hit_blocks, miss_blocks=counters.miss_blocks,
                                cached_blocks=scheduler.cached_block_count(),
                                evicted_blocks=counters.evicted_blocks)

    def abort(self, request_id: str) -> bool:
        req = self._requests.get(request_id)
        if req is None:
            return False
        if self._manager is not None:
            self._manager.cancel_request(req.internal_id)
        self._end(req)
        req.sink(GenerationEvent.cancelled(request_id))
        return True

    def _end(self, req: _HfRequest) -> None:
        """Forget a request that ended (finished, failed, aborted or never accepted)."""
        req.done = True
        if self._requests.get(req.request_id) is req:
            del self._requests[req.request_id]
        if self._seeds is not None:
            self._seeds.pop(req.internal_id, None)
        self._drop_handler(req.internal_id)

    def _drop_handler(self, internal_id: str) -> None:
        router = getattr(self._manager, "output_router", None)
        if router is not None:
            with router._lock:
                router.result_handlers.pop(internal_id, None)

    def load(self) -> LoadSnapshot:
        cfg = self.config
        active, queued, total, used = manager_load(self._manager)
        return LoadSnapshot(
            backend=self.name, model=self.model, active=active,
            queued=max(queued, len(self._requests) - active), max_active=cfg.max_batch_size,
            kv_blocks_total=total or cfg.num_blocks, kv_blocks_used=used, tokens_per_block=cfg.block_size,
            max_context=self.max_context, prompt_tokens_total=self.prompt_tokens_total,
            cached_tokens_total=self.cached_tokens_total, generated_tokens_total=self.generated_tokens_total)
