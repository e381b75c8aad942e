"""The engine backend contract: domain types and the abstract `Backend` every engine implements.

Design (callback first, iterator on top): a backend's primitive is `submit(request, sink)`. The
backend calls ``sink(event)`` on the event loop thread for every `GenerationEvent` of that request;
exactly one event has ``finished=True`` and it is the last. This keeps the per-token cost of a busy
engine at one function call (a GPU engine emits ~28k tokens/s; a queue + task switch per token
would cost more than the engine step). `generate()` wraps the same primitive as an async iterator
for callers that want one request at a time; leaving the iterator early aborts the request.

`abort(request_id)` ends a live request at once: the backend frees its slot / KV blocks and emits
a final CANCELLED event. Per-request rejections at submit time raise a `TokenrelayError` with a
machine-readable reason (EMPTY_PROMPT, CONTEXT_LENGTH_EXCEEDED, UNSUPPORTED_SAMPLING, ...);
failures after submit arrive as a final event with FINISH ERROR and ``error_reason``.

No grpc or protobuf here: TensorRT-LLM (`generate_async` + `RequestOutput.abort()`) and Triton
(decoupled `stream_infer` + `stop=True`) map onto this contract the same way the `sim` and `hf`
backends do.

Optional parts (issue 13; every default is safe, so a backend that implements none still works):
- `health()`: SERVING / DRAINING / DEAD / UNAVAILABLE. A backend whose engine dies calls
  `_set_health(DEAD)` after ending every live request with ERROR / ENGINE_UNAVAILABLE (retryable:
  the router tries another replica); the `Engine` facade then fails whatever is left, refuses new
  work and the service reports NOT_SERVING. Nothing waits on a dead engine. DEAD is final. A remote
  backend whose server stops answering uses UNAVAILABLE instead: the same, except that it keeps
  probing and sets SERVING again when the server is back (the service then reports SERVING).
- `iteration_stats()`: the latest iteration's counts (default: derived from `load()` and
  `prefix_cache_stats()`).
- `kv_events()`: a subscription to the backend's KV-cache events (`events.py`, TensorRT-LLM's
  schema); backends that emit them set ``emits_kv_events`` and publish with `publish_kv_events`.
- ``GenerationRequest.deadline`` / ``priority``: the `Engine` enforces the deadline for every
  backend (one timer per request that has one); backends that schedule (sim) also use both.
"""

from __future__ import annotations

import asyncio
import enum
import math
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from services.errors import Reason

from .events import HealthState, IterationStats, KvEvent, KvEventHub, KvEventSubscription, hit_rate


class FinishReason(enum.Enum):
    LENGTH = "length"          # max_tokens reached
    STOP = "stop"              # an EOS / stop token id was generated (and is included)
    CANCELLED = "cancelled"    # aborted
    ERROR = "error"            # rejected or failed; see error_reason


@dataclass(slots=True)
class GenerationRequest:
    """One generation, in token ids. Sampling zero values mean "default" as in the protos."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    temperature: float = 0.0           # 0 = greedy
    top_p: float = 0.0                 # 0 = 1.0
    top_k: int = 0                     # 0 = off
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    eos_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    cache_salt: str = ""
    # Absolute time.monotonic() by which the request must have finished (None = no deadline); the
    # Engine fails it with DEADLINE_EXCEEDED then, and a scheduling backend never starts it late.
    deadline: float | None = None
    # Scheduling class, higher first (common.proto's Priority: 1 low, 2 normal, 3 high; 0 = normal).
    priority: int = 0
    # W3C trace context (traceparent/tracestate) of the caller's span, carried as a plain dict so
    # the domain stays protobuf-free; empty = the request is not part of a trace.
    trace_context: dict[str, str] = field(default_factory=dict)

    def stop_set(self) -> frozenset[int]:
        """Token ids that end this request (they are emitted, then the request stops)."""
        ids = set(self.stop_token_ids)
        if not self.ignore_eos:
            ids.update(self.eos_token_ids)
        return frozenset(ids)


@dataclass(slots=True)
class GenerationEvent:
    """New tokens of one request; the last event of a request has ``finished=True``."""

    request_id: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: FinishReason | None = None
    cached_tokens: int = 0              # prompt tokens served from the prefix cache (first event)
    error_reason: str = ""
    error_message: str = ""

    @classmethod
    def cancelled(cls, request_id: str) -> GenerationEvent:
        return cls(request_id, [], True, FinishReason.CANCELLED)

    @classmethod
    def failed(cls, request_id: str, reason: str, message: str,
               token_ids: list[int] | None = None) -> GenerationEvent:
        return cls(request_id, token_ids or [], True, FinishReason.ERROR,
                   error_reason=reason, error_message=message)


Sink = Callable[[GenerationEvent], None]


@dataclass(slots=True)
class LoadSnapshot:
    backend: str
    model: str
    active: int
    queued: int
    max_active: int
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    tokens_per_block: int = 0
    max_context: int = 0
    prompt_tokens_total: int = 0
    cached_tokens_total: int = 0
    generated_tokens_total: int = 0


@dataclass(frozen=True, slots=True)
class StepStats:
    """What one engine step cost: the prompts it prefilled and the decode it ran."""

    prefill_tokens: int                  # uncached prompt tokens computed in this step (0 = none)
    prefill_seconds: float
    batch_size: int                      # requests that got a token in this step
    decode_seconds: float


StepObserver = Callable[[StepStats], None]
HealthListener = Callable[[HealthState], None]


@dataclass(frozen=True, slots=True)
class PrefixCacheStats:
    """A backend's own prefix-cache accounting since it started (block granularity)."""

    hit_blocks: int                      # full prompt blocks found in the cache
    miss_blocks: int                     # full prompt blocks that had to be computed
    cached_blocks: int                   # unreferenced blocks kept for reuse (reclaimable)
    evicted_blocks: int                  # cached blocks reclaimed for new allocations


class Backend(ABC):
    """An engine: token ids in, token ids out, many requests batched together."""

    name: str = "base"
    model: str = ""
    max_context: int = 0
    vocab_size: int = 0                  # 0 = unknown (prompt ids are then not range-checked)
    # Called on the event loop after each engine step by backends that step in Python (sim);
    # the metrics module installs it. Backends whose steps are out of sight leave it unused.
    step_observer: StepObserver | None = None
    # Called on the event loop when `health()` changes (the Engine facade installs it).
    health_listener: HealthListener | None = None
    emits_kv_events: bool = False        # True: `kv_events()` carries this backend's KV-cache events
    _health: HealthState = HealthState.SERVING
    _health_detail: str = ""
    _kv_hub: KvEventHub | None = None

    @abstractmethod
    async def start(self) -> None:
        """Load / warm up; called once before the first submit."""

    @abstractmethod
    async def close(self) -> None:
        """Abort everything still live and release resources."""

    @abstractmethod
    def submit(self, request: GenerationRequest, sink: Sink) -> None:
        """Enqueue a validated request; events go to ``sink`` on the event loop. May raise
        `TokenrelayError` (e.g. UNSUPPORTED_SAMPLING) to reject it."""

    @abstractmethod
    def abort(self, request_id: str) -> bool:
        """End a live request with CANCELLED and free its resources; False if it is not live."""

    @abstractmethod
    def load(self) -> LoadSnapshot:
        """A cheap snapshot of the engine's load (also read by the metrics scrape thread, so it
        only reads sizes and counters)."""

    def prefix_cache_stats(self) -> PrefixCacheStats | None:
        """The backend's own prefix-cache hit accounting; None where it keeps none."""
        return None

    # -- optional parts (issue 13) -------------------------------------------------------------
    def health(self) -> HealthState:
        return self._health

    @property
    def health_detail(self) -> str:
        """Why the backend is not serving ("" while it is)."""
        return self._health_detail

    def _set_health(self, state: HealthState, detail: str = "") -> None:
        """Record a health change and tell the listener; DEAD is final. Going DEAD or UNAVAILABLE
        ends the KV-event subscriptions (after DEAD none are taken any more)."""
        if state is self._health or self._health is HealthState.DEAD:
            return
        self._health, self._health_detail = state, "" if state is HealthState.SERVING else detail
        if self._kv_hub is not None:
            if state is HealthState.DEAD:
                self._kv_hub.close()
            elif state is HealthState.UNAVAILABLE:
                self._kv_hub.end_subscriptions()
        if self.health_listener is not None:
            self.health_listener(state)

    def iteration_stats(self) -> IterationStats:
        """The latest iteration's counts; cheap (read at scrape time and per load report)."""
        load = self.load()
        cache = self.prefix_cache_stats()
        reused, missed = (cache.hit_blocks, cache.miss_blocks) if cache is not None else (0, 0)
        return IterationStats(
            active=load.active, queued=load.queued, max_active=load.max_active,
            kv_blocks_total=load.kv_blocks_total, kv_blocks_used=load.kv_blocks_used,
            kv_blocks_free=max(0, load.kv_blocks_total - load.kv_blocks_used), kv_blocks_reused=reused,
            kv_blocks_missed=missed, kv_cache_hit_rate=hit_rate(reused, missed),
            tokens_per_block=load.tokens_per_block, generation_requests=load.active)

    @property
    def kv_event_hub(self) -> KvEventHub:
        if self._kv_hub is None:
            self._kv_hub = KvEventHub()
            if self._health is HealthState.DEAD:
                self._kv_hub.close()
        return self._kv_hub

    def kv_events(self) -> KvEventSubscription:
        """Subscribe to this backend's KV-cache events; iterate for ``(events, dropped)`` batches.
        A backend without events (``emits_kv_events`` False) never yields; close the subscription."""
        return self.kv_event_hub.subscribe()

    @property
    def kv_events_wanted(self) -> bool:
        """Someone is subscribed: worth building events (backends skip the work otherwise)."""
        hub = self._kv_hub
        return hub is not None and hub.subscribers > 0

    @property
    def kv_events_published(self) -> int:
        """Events published so far (0 until someone subscribed); safe from the scrape thread."""
        hub = self._kv_hub
        return hub.published if hub is not None else 0

    def publish_kv_events(self, events: list[KvEvent]) -> None:
        if self._kv_hub is not None and events:
            self._kv_hub.publish(events)

    def close_kv_events(self) -> None:
        """End every subscription (call from `close()`)."""
        if self._kv_hub is not None:
            self._kv_hub.close()

    def validate(self, request: GenerationRequest) -> None:
        """Checks every backend shares; `submit` callers run it first."""
        n = len(request.prompt_token_ids)
        if n == 0:
            raise Reason.EMPTY_PROMPT.error("prompt is empty")
        if request.max_tokens < 1:
            raise Reason.INVALID_MAX_TOKENS.error("max_tokens must be at least 1")
        if self.max_context and n + request.max_tokens > self.max_context:
            raise Reason.CONTEXT_LENGTH_EXCEEDED.error(
                f"prompt ({n}) + max_tokens ({request.max_tokens}) exceeds the model context "
                f"({self.max_context})")
        if self.vocab_size and max(request.prompt_token_ids) >= self.vocab_size:
            raise Reason.INVALID_TOKEN_ID.error(f"prompt token id beyond the vocabulary ({self.vocab_size})")
        if self.vocab_size and max((*request.eos_token_ids, *request.stop_token_ids), default=0) >= self.vocab_size:
            raise Reason.INVALID_TOKEN_ID.error(f"EOS or stop token id beyond the vocabulary ({self.vocab_size})")
        # `not 0 <= x` also refuses NaN; an infinite temperature is finite nowhere in a sampler.
        if not 0 <= request.temperature < math.inf or not 0 <= request.top_p <= 1 or request.top_k < 0:
            raise Reason.INVALID_SAMPLING.error("temperature must be finite and >= 0, top_p in [0, 1], top_k >= 0")

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        """One request as an async iterator; closing or cancelling the consumer aborts it."""
        self.validate(request)
        queue: asyncio.Queue[GenerationEvent] = asyncio.Queue()
        self.submit(request, queue.put_nowait)
        finished = False
        try:
            while not finished:
                event = await queue.get()
                finished = event.finished
                yield event
        finally:
            if not finished:
                self.abort(request.request_id)
