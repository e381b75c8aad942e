"""`hf`: a real model with Hugging Face transformers continuous batching (CPU or one GPU).

One persistent `ContinuousBatchingManager` runs the model in its own thread; its outputs come back
on the event loop through `register_result_handler` (``call_soon_threadsafe``). Facts of
transformers 5.24.0 this module is built around:

- Sampling is decided per manager (``do_sample``). With ``per_request_processors=True`` the
  temperature / top-k / top-p warpers take per-request values, but only warpers that exist in the
  manager's GenerationConfig. With sampling on, every warper is created and a greedy request is
  sent as top_k=1 (the multinomial draw then has one candidate: argmax, matching
  ``generate(do_sample=False)``); `hf_sampling` swaps in warpers that only pay for what a row asks.
  There is no per-request seed (one RNG for the batch), so a
  sampled request with a seed is rejected with UNSUPPORTED_SAMPLING rather than silently made
  irreproducible; with sampling off (``--no-hf-sampling``) any temperature > 0 is rejected.
- `cancel_request` never produces a terminal output, so `abort` ends the request itself and
  drops the result handler the manager would otherwise keep forever.
- No processor of the model's own generation_config (repetition penalty, ...) is applied; EOS ids
  come from the request, or from the model when the request names none.
- The manager steps in its own thread, out of sight: this backend reports no per-step timings
  (`step_observer` stays unused) and no prefix-cache statistics. Its prefill and decode cost
  show in the engine's per-request metrics instead — time to first token and time per output
  token as seen by the result callbacks on the event loop (see engine_svc/metrics.py).

torch and transformers are imported only when the backend starts.
"""

from __future__ import annotations

import asyncio
import functools
import os
from typing import Any, Literal

from pydantic import Field

from services.config import Section, flag
from services.errors import Reason
from services.logging import get_logger

from .base import Backend, FinishReason, GenerationEvent, GenerationRequest, LoadSnapshot, Sink

log = get_logger(__name__)

_FAILED = 4  # transformers RequestStatus.FAILED


class HfConfig(Section):
    """The transformers continuous-batching engine: device, precision and batch limits."""

    model: str = Field("", description="model directory (config.json + safetensors)",
                       json_schema_extra=flag(None))   # set by the engine's --model
    device: str = Field("cpu", min_length=1, description="torch device (cpu, cuda, cuda:1, ...)")
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = Field(
        "float32", description="weights' dtype (auto = the checkpoint's)")
    threads: int = Field(0, ge=0, description="torch.set_num_threads (0 = torch's default)")
    num_blocks: int = Field(256, ge=1, description="KV cache blocks")
    block_size: int = Field(32, ge=1, description="tokens per KV block (page)")
    max_batch_tokens: int = Field(512, ge=1, description="tokens per forward pass")
    max_batch_size: int = Field(32, ge=1, description="requests per forward pass")
    sampling: bool = Field(True, description="allow temperature > 0 (per-request temperature, top_p, top_k); "
                                             "off = a greedy-only engine")
    random_weights: bool = Field(False, description="build the model from config.json with random weights "
                                                    "(capacity tests of a model shape; outputs are noise)")


class _HfRequest:
    __slots__ = ("done", "internal_id", "request_id", "sent", "sink", "stop")

    def __init__(self, request_id: str, internal_id: str, sink: Sink, stop: frozenset[int]) -> None:
        self.request_id = request_id
        self.internal_id = internal_id
        self.sink = sink
        self.stop = stop
        self.sent = 0
        self.done = False


class HfBackend(Backend):
    name = "hf"

    def __init__(self, config: HfConfig) -> None:
        self.config = config
        self.model = os.path.basename(os.path.normpath(config.model)) if config.model else ""
        self._manager: Any = None
        self._model_eos: tuple[int, ...] = ()
        self._requests: dict[str, _HfRequest] = {}
        self._counter = 0
        self.prompt_tokens_total = 0
        self.generated_tokens_total = 0

    # -- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        # Loading takes seconds to minutes: keep it off the event loop.
        await asyncio.to_thread(self._load)
        log.info("hf_engine_ready", model=self.config.model, device=self.config.device,
                 max_context=self.max_context, vocab_size=self.vocab_size, sampling=self.config.sampling)

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
        text_config = model.config.get_text_config()
        self.max_context = int(text_config.max_position_embeddings)
        self.vocab_size = int(text_config.vocab_size)
        self._model_eos = _eos_ids(model)
        manager = model.init_continuous_batching(
            generation_config=self._generation_config(), continuous_batching_config=self._cb_config())
        if cfg.sampling:
            from .hf_sampling import install_fast_warpers

            install_fast_warpers(manager)
        manager.start()
        self._manager = manager

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
        return ContinuousBatchingConfig(
            num_blocks=cfg.num_blocks, max_batch_tokens=cfg.max_batch_tokens, page_size=cfg.block_size,
            max_requests_per_batch=cfg.max_batch_size, per_request_processors=cfg.sampling,
            auto_switch_to_flash=False)

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
        if request.seed is not None:
            raise Reason.UNSUPPORTED_SAMPLING.error("per-request seeds are not supported by the hf backend "
                                                    "(transformers continuous batching has one RNG)")
        return {"temperature": float(request.temperature),
                "top_k": int(request.top_k or self.vocab_size),
                "top_p": float(request.top_p or 1.0)}

    def submit(self, request: GenerationRequest, sink: Sink) -> None:
        manager = self._manager
        if manager is None:
            raise Reason.ENGINE_UNAVAILABLE.error("the hf engine is not running")
        kwargs = self._sampling_kwargs(request)
        eos = () if request.ignore_eos else (request.eos_token_ids or self._model_eos)
        stop = frozenset((*request.stop_token_ids, *eos))
        self._counter += 1
        # Internal ids never repeat: a cancelled id may linger in the manager for a step.
        req = _HfRequest(request.request_id, f"{self._counter}:{request.request_id}", sink, stop)
        manager.register_result_handler(req.internal_id, functools.partial(self._on_output, req))
        added = manager.add_request(list(request.prompt_token_ids), request_id=req.internal_id,
                                    max_new_tokens=request.max_tokens, streaming=True,
                                    eos_token_id=sorted(stop), **kwargs)
        if added is None:
            self._drop_handler(req.internal_id)
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
            event = GenerationEvent.failed(req.request_id, Reason.ENGINE_ERROR,
                                           f"generation failed: {output.error}", new)
        elif output.is_finished():
            stopped = bool(tokens) and tokens[-1] in req.stop
            event = GenerationEvent(req.request_id, new, True,
                                    FinishReason.STOP if stopped else FinishReason.LENGTH)
        elif new:
            event = GenerationEvent(req.request_id, new)
        else:
            return
        if event.finished:
            req.done = True
            self._requests.pop(req.request_id, None)
        req.sink(event)

    def abort(self, request_id: str) -> bool:
        req = self._requests.pop(request_id, None)
        if req is None:
            return False
        req.done = True
        if self._manager is not None:
            self._manager.cancel_request(req.internal_id)
            self._drop_handler(req.internal_id)
        req.sink(GenerationEvent.cancelled(request_id))
        return True

    def _drop_handler(self, internal_id: str) -> None:
        router = getattr(self._manager, "output_router", None)
        if router is not None:
            with router._lock:
                router.result_handlers.pop(internal_id, None)

    def load(self) -> LoadSnapshot:
        cfg = self.config
        active, queued, total, used = _manager_load(self._manager)
        return LoadSnapshot(
            backend=self.name, model=self.model, active=active,
            queued=max(queued, len(self._requests) - active), max_active=cfg.max_batch_size,
            kv_blocks_total=total or cfg.num_blocks, kv_blocks_used=used, tokens_per_block=cfg.block_size,
            max_context=self.max_context, prompt_tokens_total=self.prompt_tokens_total,
            generated_tokens_total=self.generated_tokens_total)


def _eos_ids(model: Any) -> tuple[int, ...]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(int(e) for e in ([eos] if isinstance(eos, int) else eos) if int(e) >= 0)


def _manager_load(manager: Any) -> tuple[int, int, int, int]:
    """(active, queued, kv blocks total, kv blocks referenced) read from the manager's internals.

    These are private attributes of transformers 5.24; read defensively so that a version that
    renames them degrades to zeros instead of failing GetLoad.
    """
    processor = getattr(manager, "batch_processor", None)
    scheduler = getattr(processor, "scheduler", None)
    cache = getattr(processor, "cache", None)
    if scheduler is None or cache is None:
        return 0, 0, 0, 0
    try:
        active = len(scheduler.active_requests)
        queued = len(scheduler.waiting_requests) + manager.input_queue.qsize()
        allocator = next(iter(cache.cache_allocators.values()))
        used = len(set().union(*list(allocator.block_table.values())))
        return active, queued, int(allocator.num_blocks), used
    except (AttributeError, StopIteration, RuntimeError):
        return 0, 0, 0, 0
