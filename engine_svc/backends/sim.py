"""`sim`: a simulated engine with a calibrated cost model, for tests and capacity planning.

One stepping task does in-flight batching the way TensorRT-LLM's executor does: each step admits
waiting requests (FIFO) while the batch has room, the prefill token budget allows and the KV cache
can reserve prompt + max_tokens (GUARANTEED_NO_EVICT, TensorRT-LLM's default policy, so nothing is
ever preempted); it charges ``prefill_time_per_token`` for the admitted prompts' uncached tokens,
then one decode step (``decode_step_time + decode_time_per_seq * batch``) in which every running
request gets one token. Steps are paced on a virtual clock, so Python overhead is absorbed rather
than added to the simulated time. Each step reports what the cost model charged for it (prefill
and decode seconds, batch size) to ``step_observer``: the step time the modelled GPU would take.

Tokens are a deterministic function of (seed, prompt, position) over ``vocab_size``: each token is
drawn from a rolling hash of the whole context (prompt + tokens so far), mixed with the seed. Like a
greedy real model, resubmitting prompt + the tokens generated so far continues with the very same
tokens (what a router's token migration relies on). Greedy requests (temperature 0) ignore the
seed; sampled requests without a seed draw one at random.
With ``eos_probability`` > 0 a request emits its first EOS id with that probability per token.

Defaults approximate one H200 running Llama-3-8B (FP8) with TensorRT-LLM, fitted to its published
throughput with this additive model: prefill 18 µs per uncached token (~56k tokens/s, which the
2048/128 figure of 3.5k output tokens/s implies) and a decode step of 2.5 ms + 8 µs per sequence
(4.6 ms at batch 256). Together they give ~28k output tokens/s at 128/128 and batch 256 and
~3.3k at 2048/128, the published 27.9k and 3.5k. (A 9 ms step at batch 256 would cap 128/128 at
~16k tokens/s once prefill is charged.) The model has no attention term, so long contexts
(1000/1000) come out optimistic. KV cache: 25,000 blocks × 32 tokens (Llama-3-8B holds 128 KiB
of KV per token; ~100 GB are left after FP8 weights).
"""

from __future__ import annotations

import asyncio
import random
import time

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
    StepStats,
)
from .sim_kv import Allocation, KVCache

log = get_logger(__name__)

_MASK64 = (1 << 64) - 1
_FNV_OFFSET = 0xCBF29CE484222325
_FNV_PRIME = 0x100000001B3
_EOS_BITS = 24


class SimConfig(Section):
    """The simulated GPU: batch limits, KV cache and cost model (defaults: one H200, Llama-3-8B FP8)."""

    model: str = Field("sim-llama-8b", description="the model name to report",
                       json_schema_extra=flag(None))   # set by the engine's --model
    max_batch_size: int = Field(256, ge=1, description="requests decoded per step")
    max_num_tokens: int = Field(8192, ge=1, description="prompt tokens admitted per step "
                                                        "(TensorRT-LLM's max_num_tokens)")
    num_blocks: int = Field(25_000, ge=1, description="KV cache blocks")
    tokens_per_block: int = Field(32, ge=1, description="tokens per KV block")
    vocab_size: int = Field(128_256, ge=1, description="vocabulary size of generated ids")
    max_context: int = Field(8192, ge=1, description="model context (prompt + max_tokens)")
    prefill_time_per_token: float = Field(18e-6, ge=0, description="seconds per uncached prompt token")
    decode_step_time: float = Field(0.0025, ge=0, description="fixed seconds per decode step")
    decode_time_per_seq: float = Field(8e-6, ge=0, description="extra decode-step seconds per running request")
    eos_probability: float = Field(0.0, ge=0, le=1, description="chance per token of emitting the request's "
                                                                "EOS id")


def context_state(tokens: list[int], state: int = _FNV_OFFSET) -> int:
    """Fold tokens into the rolling context hash (FNV-1a over token ids)."""
    for t in tokens:
        state = ((state ^ t) * _FNV_PRIME) & _MASK64
    return state


def mix64(x: int) -> int:
    """splitmix64's finaliser: spreads the rolling hash over all 64 bits."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


class _SimRequest:
    __slots__ = ("alloc", "eos", "eos_threshold", "first", "generated", "hashes", "max_tokens", "prompt",
                 "request_id", "salt", "seed_mix", "sink", "state", "stop")

    def __init__(self, request: GenerationRequest, sink: Sink, hashes: list[int], eos_p: float) -> None:
        self.request_id = request.request_id
        self.prompt = request.prompt_token_ids
        self.max_tokens = request.max_tokens
        self.salt = request.cache_salt
        self.sink = sink
        self.stop = request.stop_set()
        self.hashes = hashes
        self.seed_mix = 0
        if request.temperature > 0:
            seed = request.seed if request.seed is not None else random.getrandbits(63)
            self.seed_mix = mix64((seed + 1) & _MASK64)
        self.state = context_state(request.prompt_token_ids)
        self.eos = request.eos_token_ids[0] if request.eos_token_ids else None
        self.eos_threshold = int(eos_p * (1 << _EOS_BITS)) if self.eos is not None else 0
        self.generated = 0
        self.first = True
        self.alloc: Allocation | None = None

    def next_token(self, vocab_size: int) -> int:
        x = mix64(self.state ^ self.seed_mix)
        if self.eos_threshold and (x >> (64 - _EOS_BITS)) < self.eos_threshold:
            token: int = self.eos  # type: ignore[assignment]
        else:
            token = x % vocab_size
        self.state = ((self.state ^ token) * _FNV_PRIME) & _MASK64
        return token


class SimBackend(Backend):
    name = "sim"

    def __init__(self, config: SimConfig | None = None) -> None:
        self.config = cfg = config or SimConfig()
        self.model = cfg.model
        self.max_context = min(cfg.max_context, cfg.num_blocks * cfg.tokens_per_block)
        self.vocab_size = cfg.vocab_size
        self.kv = KVCache(cfg.num_blocks, cfg.tokens_per_block)
        self._waiting: dict[str, _SimRequest] = {}
        self._running: dict[str, _SimRequest] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.steps = 0
        self.prompt_tokens_total = 0
        self.cached_tokens_total = 0
        self.generated_tokens_total = 0

    # -- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="sim-engine-steps")

    async def close(self) -> None:
        for request_id in [*self._waiting, *self._running]:
            self.abort(request_id)
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    # -- requests -----------------------------------------------------------------------------
    def submit(self, request: GenerationRequest, sink: Sink) -> None:
        if self.kv.blocks_for(len(request.prompt_token_ids) + request.max_tokens) > self.kv.num_blocks:
            raise Reason.CONTEXT_LENGTH_EXCEEDED.error("request needs more KV blocks than the cache holds")
        hashes = self.kv.prompt_hashes(request.prompt_token_ids, request.cache_salt)
        self._waiting[request.request_id] = _SimRequest(request, sink, hashes, self.config.eos_probability)
        self._wake.set()

    def abort(self, request_id: str) -> bool:
        req = self._waiting.pop(request_id, None) or self._running.pop(request_id, None)
        if req is None:
            return False
        if req.alloc is not None:
            self.kv.release(req.alloc)
            req.alloc = None  # marks it dead for a decode loop that is iterating right now
        req.sink(GenerationEvent.cancelled(request_id))
        return True

    def load(self) -> LoadSnapshot:
        cfg = self.config
        return LoadSnapshot(
            backend=self.name, model=self.model, active=len(self._running), queued=len(self._waiting),
            max_active=cfg.max_batch_size, kv_blocks_total=cfg.num_blocks,
            kv_blocks_used=self.kv.used_blocks, tokens_per_block=cfg.tokens_per_block,
            max_context=self.max_context, prompt_tokens_total=self.prompt_tokens_total,
            cached_tokens_total=self.cached_tokens_total,
            generated_tokens_total=self.generated_tokens_total)

    def prefix_cache_stats(self) -> PrefixCacheStats:
        kv = self.kv
        return PrefixCacheStats(kv.hit_blocks, kv.miss_blocks, kv.cached_blocks, kv.evictions)

    # -- the stepping loop --------------------------------------------------------------------
    async def _run(self) -> None:
        clock = time.perf_counter()
        while True:
            admitted_tokens = self._admit()
            if not self._running:
                self._wake.clear()
                await self._wake.wait()
                clock = time.perf_counter()
            else:
                cfg = self.config
                batch = len(self._running)
                prefill_seconds = admitted_tokens * cfg.prefill_time_per_token
                decode_seconds = cfg.decode_step_time + cfg.decode_time_per_seq * batch
                clock += prefill_seconds + decode_seconds
                delay = clock - time.perf_counter()
                # Always yield, even with zero costs, so gRPC and other tasks keep running.
                await asyncio.sleep(delay if delay > 0 else 0)
                if delay < -0.05:
                    clock = time.perf_counter()  # fell behind (overloaded CPU): don't burst
                self._decode()
                if self.step_observer is not None:
                    self.step_observer(StepStats(admitted_tokens, prefill_seconds, batch, decode_seconds))

    def _admit(self) -> int:
        """Move waiting requests into the batch; returns the uncached prompt tokens to prefill."""
        cfg = self.config
        budget = cfg.max_num_tokens
        prefill = 0
        while self._waiting and len(self._running) < cfg.max_batch_size:
            req = next(iter(self._waiting.values()))
            uncached_upper = len(req.prompt)
            if prefill and prefill + uncached_upper > budget:
                break
            alloc = self.kv.try_allocate(req.prompt, len(req.prompt) + req.max_tokens, req.salt,
                                         req.hashes)
            if alloc is None:
                break  # FIFO: no overtaking, so large requests cannot starve
            del self._waiting[req.request_id]
            req.alloc = alloc
            self._running[req.request_id] = req
            prefill += len(req.prompt) - alloc.cached_tokens
            self.prompt_tokens_total += len(req.prompt)
            self.cached_tokens_total += alloc.cached_tokens
        return prefill

    def _decode(self) -> None:
        """One token for every running request."""
        self.steps += 1
        vocab = self.config.vocab_size
        kv = self.kv
        finished: list[_SimRequest] = []
        for req in list(self._running.values()):
            alloc = req.alloc
            if alloc is None:
                continue  # aborted by a sink earlier in this loop
            token = req.next_token(vocab)
            req.generated += 1
            kv.append_token(alloc, token)
            reason = None
            if token in req.stop:
                reason = FinishReason.STOP
            elif req.generated >= req.max_tokens:
                reason = FinishReason.LENGTH
            event = GenerationEvent(req.request_id, [token], reason is not None, reason)
            if req.first:
                req.first = False
                event.cached_tokens = alloc.cached_tokens
            if reason is not None:
                finished.append(req)
            req.sink(event)
            self.generated_tokens_total += 1
        for req in finished:
            if self._running.pop(req.request_id, None) is not None and req.alloc is not None:
                kv.release(req.alloc)
                req.alloc = None
