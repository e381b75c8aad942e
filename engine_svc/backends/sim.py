"""`sim`: a simulated engine with a calibrated cost model, for tests and capacity planning.

One stepping task does in-flight batching the way TensorRT-LLM's executor does: each step admits
waiting requests (by priority, FIFO within one) while the batch has room, the prefill token budget
allows and the KV cache can reserve prompt + max_tokens (GUARANTEED_NO_EVICT, TensorRT-LLM's
default policy, so nothing is ever preempted); it charges the cost model's prefill for the admitted
prompts' uncached tokens, then one decode step (a fixed part, a part per running request and a
part per token of context in the batch) in which every running request gets one token. Steps are
paced on a virtual clock, so Python overhead is absorbed rather than added to the simulated time.
Each step reports what the cost model charged for it (prefill and decode seconds, batch size) to
``step_observer``: the step time the modelled GPU would take.

Tokens are a deterministic function of (seed, prompt, position) over ``vocab_size`` (or the range
``sample_ids_from``..``sample_ids_below``): each token is drawn from a rolling hash of the whole
context (prompt + tokens so far), mixed with the seed. Like a greedy real model, resubmitting
prompt + the tokens generated so far continues with the very same tokens (what a router's token
migration relies on). Greedy requests (temperature 0) ignore the seed; sampled requests without a
seed draw one at random.
With ``eos_probability`` > 0 a request emits its first EOS id with that probability per token.

The cost model, its settings and the profiles it is calibrated to (the default: one H200 running
Llama 3.1 8B FP8 with TensorRT-LLM) are in `sim_cost.py`; ``time_scale`` runs it faster than real
time (0: no pacing, simulated time still accounted in `sim_seconds`).

The contract's optional parts, all implemented here: admission takes the highest ``priority``
first (FIFO within one), never starts a request whose ``deadline`` passed, reports
`iteration_stats()` per step, publishes the KV cache's stored / removed events while someone
subscribes, and dies on purpose after ``die_after_steps`` (or when its stepping task fails): every
live request then ends with ERROR / ENGINE_UNAVAILABLE and `health()` is DEAD.
"""

from __future__ import annotations

import asyncio
import random
import time

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
from .events import HealthState, IterationStats, KvEventSubscription, hit_rate
from .sim_cost import SimConfig
from .sim_kv import Allocation, KVCache

__all__ = ["SimBackend", "SimConfig"]

log = get_logger(__name__)

_MASK64 = (1 << 64) - 1
_FNV_OFFSET = 0xCBF29CE484222325
_FNV_PRIME = 0x100000001B3
_EOS_BITS = 24
_NORMAL = 2   # common.proto's PRIORITY_NORMAL: what an unspecified priority (0) schedules as


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
    __slots__ = ("alloc", "deadline", "eos", "eos_threshold", "first", "generated", "hashes", "max_tokens",
                 "priority", "prompt", "request_id", "salt", "seed_mix", "sink", "state", "stop")

    def __init__(self, request: GenerationRequest, sink: Sink, hashes: list[int], eos_p: float) -> None:
        self.request_id = request.request_id
        self.prompt = request.prompt_token_ids
        self.max_tokens = request.max_tokens
        self.salt = request.cache_salt
        self.deadline = request.deadline
        self.priority = request.priority or _NORMAL
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

    def next_token(self, first: int, span: int) -> int:
        x = mix64(self.state ^ self.seed_mix)
        if self.eos_threshold and (x >> (64 - _EOS_BITS)) < self.eos_threshold:
            token: int = self.eos  # type: ignore[assignment]
        else:
            token = first + x % span
        self.state = ((self.state ^ token) * _FNV_PRIME) & _MASK64
        return token


class SimBackend(Backend):
    name = "sim"
    emits_kv_events = True

    def __init__(self, config: SimConfig | None = None) -> None:
        self.config = cfg = config or SimConfig()
        self.model = cfg.model
        self.max_context = min(cfg.max_context, cfg.num_blocks * cfg.tokens_per_block)
        self.vocab_size = cfg.vocab_size
        self.kv = KVCache(cfg.num_blocks, cfg.tokens_per_block)
        self._waiting: dict[str, _SimRequest] = {}
        self._queues: dict[int, dict[str, _SimRequest]] = {}     # priority -> its waiting requests, FIFO
        self._running: dict[str, _SimRequest] = {}
        self._context = 0                 # prompt + generated tokens over the running batch
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._last = IterationStats()
        self.steps = 0
        self.sim_seconds = 0.0            # simulated engine time charged so far
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
        self.close_kv_events()

    def die(self, detail: str) -> None:
        """The simulated executor fails: every live request ends with a retryable ENGINE_UNAVAILABLE,
        nothing is accepted any more, health is DEAD."""
        if self.health() is HealthState.DEAD:
            return
        log.error("sim_engine_died", detail=detail, live=len(self._waiting) + len(self._running))
        doomed = [*self._waiting.values(), *self._running.values()]
        self._waiting.clear()
        self._queues.clear()
        self._running.clear()
        for req in doomed:
            if req.alloc is not None:
                self.kv.release(req.alloc)
                req.alloc = None
            req.sink(GenerationEvent.failed(req.request_id, Reason.ENGINE_UNAVAILABLE, f"engine died: {detail}"))
        self._set_health(HealthState.DEAD, detail)

    # -- requests -----------------------------------------------------------------------------
    def submit(self, request: GenerationRequest, sink: Sink) -> None:
        if self.health() is HealthState.DEAD:
            raise Reason.ENGINE_UNAVAILABLE.error(f"the sim engine is dead: {self.health_detail}")
        if self.kv.blocks_for(len(request.prompt_token_ids) + request.max_tokens) > self.kv.num_blocks:
            raise Reason.CONTEXT_LENGTH_EXCEEDED.error("request needs more KV blocks than the cache holds")
        hashes = self.kv.prompt_hashes(request.prompt_token_ids, request.cache_salt)
        req = _SimRequest(request, sink, hashes, self.config.eos_probability)
        self._waiting[request.request_id] = req
        self._queues.setdefault(req.priority, {})[request.request_id] = req
        self._wake.set()

    def _unqueue(self, req: _SimRequest) -> None:
        del self._waiting[req.request_id]
        queue = self._queues[req.priority]
        del queue[req.request_id]
        if not queue:
            del self._queues[req.priority]

    def abort(self, request_id: str) -> bool:
        req = self._waiting.get(request_id)
        if req is not None:
            self._unqueue(req)
        else:
            req = self._running.pop(request_id, None)
            if req is None:
                return False
            self._context -= len(req.prompt) + req.generated
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

    def iteration_stats(self) -> IterationStats:
        """The last step's counts, with the queue and KV as they are now."""
        kv, last = self.kv, self._last
        return IterationStats(
            iteration=self.steps, active=len(self._running), queued=len(self._waiting),
            max_active=self.config.max_batch_size, kv_blocks_total=kv.num_blocks, kv_blocks_used=kv.used_blocks,
            kv_blocks_free=kv.num_blocks - kv.used_blocks, kv_blocks_reused=kv.hit_blocks,
            kv_blocks_missed=kv.miss_blocks, kv_cache_hit_rate=hit_rate(kv.hit_blocks, kv.miss_blocks),
            tokens_per_block=kv.tokens_per_block, context_requests=last.context_requests,
            generation_requests=last.generation_requests, iteration_latency_ms=last.iteration_latency_ms)

    # -- the stepping loop --------------------------------------------------------------------
    async def _run(self) -> None:
        try:
            await self._steps()
        except asyncio.CancelledError:
            raise
        except Exception as exc:   # a bug in a step is the engine dying, not a hang
            log.exception("sim_step_failed")
            self.die(f"step failed: {exc!r}")

    async def _steps(self) -> None:
        cfg = self.config
        clock = time.perf_counter()
        while True:
            self.kv.record_events = self.kv_events_wanted
            admitted, admitted_tokens = self._admit()
            if not self._running:
                self._publish_events()
                self._wake.clear()
                await self._wake.wait()
                clock = time.perf_counter()
                continue
            batch = len(self._running)
            prefill_seconds, decode_seconds = cfg.step_seconds(admitted_tokens, batch, self._context)
            charged = prefill_seconds + decode_seconds
            self.sim_seconds += charged
            clock += charged * cfg.time_scale
            delay = clock - time.perf_counter()
            # Always yield, even with zero costs, so gRPC and other tasks keep running.
            await asyncio.sleep(delay if delay > 0 else 0)
            if delay < -0.05:
                clock = time.perf_counter()  # fell behind (overloaded CPU): don't burst
            self._decode()
            self._last = IterationStats(context_requests=admitted, generation_requests=batch - admitted,
                                        iteration_latency_ms=charged * 1e3)
            self._publish_events()
            if self.step_observer is not None:
                self.step_observer(StepStats(admitted_tokens, prefill_seconds, batch, decode_seconds))
            if cfg.die_after_steps and self.steps >= cfg.die_after_steps:
                self.die(f"die_after_steps={cfg.die_after_steps} reached")
                return

    def kv_events(self) -> KvEventSubscription:
        """A new subscriber first gets a snapshot of every registered block, then live events
        (recording starts at once, so nothing between the two is missed)."""
        sub = super().kv_events()
        if not sub.closed:
            self.kv.record_events = True
            sub.offer_snapshot(self.kv.snapshot_events())
        return sub

    def _publish_events(self) -> None:
        if self.kv.record_events:
            self.publish_kv_events(self.kv.take_events())

    def _next_waiting(self) -> _SimRequest | None:
        if not self._queues:
            return None
        queue = self._queues[max(self._queues)]
        return next(iter(queue.values()))

    def _admit(self) -> tuple[int, int]:
        """Move waiting requests into the batch (highest priority first, FIFO within one);
        returns (requests admitted, uncached prompt tokens to prefill)."""
        cfg = self.config
        budget = cfg.max_num_tokens
        prefill = admitted = 0
        now = time.monotonic()
        while len(self._running) < cfg.max_batch_size:
            req = self._next_waiting()
            if req is None:
                break
            if req.deadline is not None and req.deadline <= now:
                self._unqueue(req)   # never spend a prefill on a request nobody waits for any more
                req.sink(GenerationEvent.failed(req.request_id, Reason.DEADLINE_EXCEEDED,
                                                "the request's deadline passed before it was scheduled"))
                continue
            if prefill and prefill + len(req.prompt) > budget:
                break
            alloc = self.kv.try_allocate(req.prompt, len(req.prompt) + req.max_tokens, req.salt,
                                         req.hashes)
            if alloc is None:
                break  # no overtaking within a class, so large requests cannot starve
            self._unqueue(req)
            req.alloc = alloc
            self._running[req.request_id] = req
            self._context += len(req.prompt)
            admitted += 1
            prefill += len(req.prompt) - alloc.cached_tokens
            self.prompt_tokens_total += len(req.prompt)
            self.cached_tokens_total += alloc.cached_tokens
        return admitted, prefill

    def _decode(self) -> None:
        """One token for every running request."""
        self.steps += 1
        first, below = self.config.sample_range()
        span = below - first
        kv = self.kv
        finished: list[_SimRequest] = []
        for req in list(self._running.values()):
            alloc = req.alloc
            if alloc is None:
                continue  # aborted by a sink earlier in this loop
            token = req.next_token(first, span)
            req.generated += 1
            self._context += 1
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
                self._context -= len(req.prompt) + req.generated
                kv.release(req.alloc)
                req.alloc = None
