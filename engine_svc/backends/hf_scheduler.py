"""The `hf` backend's scheduler: chunked prefill where short prompts never wait behind a long one,
and the prefix-cache accounting transformers keeps to itself.

transformers 5.24 already splits a prompt across steps: each step computes at most
``max_batch_tokens`` tokens, and a prompt longer than what is left of that budget is cut and
continued next step. But its FIFO scheduler orders a step as decoding requests, then prompts
already being prefilled, then waiting requests, and the unfinished prompt takes whatever budget is
left. So a 6-token request that arrives while an 8k-token prompt is being prefilled waits for the
whole prefill (16 steps of 512 tokens), and a long prompt arriving first holds up every prompt
behind it (issue 14 item 5 saw 60 s behind an 8k prefill on the CPU mesh).

`ShortFirstScheduler` keeps the decode-first rule and changes the prefill order: prompts go
shortest remaining part first (arrival order among equals), and one prompt takes at most
``prefill_chunk_tokens`` of a step, so several long prompts advance together instead of one after
another. A request whose prompt fits in a step then has its first token after at most the step in
flight plus its own step, each at most ``max_batch_tokens`` tokens, whatever the long prompts
ahead of it; a longer one waits only for prompts shorter than what it has left. A long prompt
gets every token of a step that shorter prompts and the decoders leave (decoders take one token
each, ``max_batch_size`` bounds them): only a sustained flood of shorter prompts, which the
router's admission limits bound, can hold it back — the order an interactive mesh wants.

Prefix cache: transformers shares complete KV blocks between prompts with the same prefix when
every attention layer of the model allows it (full attention: Llama, Mistral, Qwen; not models with
sliding-window layers such as Gemma 3, where ``prefix_sharing`` is False and nothing is counted).
The scheduler records each request's matched tokens when it first looks at it, so the backend can
report ``cached_tokens`` per request and block hit / miss / eviction counts.

Imports transformers: import this module only from the hf backend's loader.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from transformers.generation.continuous_batching import scheduler as _cb_scheduler
from transformers.generation.continuous_batching.requests import RequestState, RequestStatus

SCHEDULER_NAME = "tokenrelay_short_first"


@dataclass(slots=True)
class PrefixCounters:
    """Written by the generation thread only; read (ints, atomically) by the event loop."""

    hit_blocks: int = 0
    miss_blocks: int = 0
    evicted_blocks: int = 0


class ShortFirstScheduler(_cb_scheduler.FIFOScheduler):
    """Decode first, then prompts shortest first, each in chunks (see the module docstring)."""

    # Set on the subclass `configure` makes (transformers instantiates the class itself).
    prefill_chunk_tokens: int = 256

    def __init__(self, cache: Any, safety_margin: float | None, max_requests_per_batch: int) -> None:
        super().__init__(cache, safety_margin, max_requests_per_batch)
        self.block_size = _page_size(cache)
        self.counters = PrefixCounters()
        # request id -> prompt tokens served from the prefix cache, until the backend takes it
        self.cached_tokens: dict[str, int] = {}
        self._wrap_eviction(cache)

    # -- ordering -------------------------------------------------------------------------------
    def schedule_batch(self, token_budget: int, cache_budget: int) -> tuple[Any, bool, int, int]:
        decoding: list[RequestState] = []
        prefill: list[RequestState] = []
        for state in self.active_requests.values():
            if state.status == RequestStatus.DECODING:
                decoding.append(state)
            elif state.status == RequestStatus.PREFILLING:
                prefill.append(state)
        if not self.block_new_requests:
            prefill.extend(self._get_waiting_candidates())
        prefill.sort(key=lambda state: len(state.remaining_prefill_tokens))   # stable: FIFO among equals
        removed: set[str] = set()
        scheduled, allocation_failed, fast_path, q_tokens, kv_read = self._process_candidates(
            decoding + prefill, token_budget, cache_budget, removed)
        self._cleanup_waiting_queue(removed)
        if not scheduled and allocation_failed:
            return None, fast_path, 0, 0
        return scheduled, fast_path, q_tokens, kv_read

    # -- chunking -------------------------------------------------------------------------------
    def _infer_request_tokens(self, state: RequestState, removed: set[str]) -> list[int]:
        pending = state.status == RequestStatus.PENDING and not state.is_cpu_offloaded
        before = len(state.remaining_prefill_tokens)
        tokens = super()._infer_request_tokens(state, removed)
        if pending:  # transformers looks for a prefix match on each look at a waiting request
            self._count_prefix(state.request_id, before, before - len(state.remaining_prefill_tokens))
        if state.status == RequestStatus.DECODING:
            return tokens
        # What this step may take of the prompt: the caller sizes the cache allocation from it.
        return tokens[:self.prefill_chunk_tokens]

    def _schedule_request(self, state: RequestState, request_tokens: list[int], token_budget: int,
                          removed: set[str]) -> None:
        if state.status != RequestStatus.DECODING:
            # The whole remaining prompt, cut at this request's share of the step.
            request_tokens = state.remaining_prefill_tokens
            token_budget = min(token_budget, self.prefill_chunk_tokens)
        super()._schedule_request(state, request_tokens, token_budget, removed)

    # -- prefix-cache accounting ----------------------------------------------------------------
    def _count_prefix(self, request_id: str, prompt_len: int, matched: int) -> None:
        """Counted once per request: at its first look, and again only if a later look matched
        (the shared prefix's blocks were completed meanwhile by another request)."""
        first = request_id not in self.cached_tokens
        if not first and not matched:
            return
        self.cached_tokens[request_id] = matched
        if not (self.block_size and self.cache.use_prefix_sharing):
            return
        hits = matched // self.block_size
        self.counters.hit_blocks += hits
        if first:
            self.counters.miss_blocks += max(0, prompt_len // self.block_size - hits)
        else:
            self.counters.miss_blocks -= hits

    def clear_cancelled_requests(self) -> list[RequestState]:
        cancelled = super().clear_cancelled_requests()
        for state in cancelled:
            self.cached_tokens.pop(state.request_id, None)
        return cancelled

    def cached_block_count(self) -> int:
        try:
            return sum(len(a.ledger.cached_blocks) for a in self.cache.cache_allocators.values())
        except (AttributeError, RuntimeError):
            return 0

    def _wrap_eviction(self, cache: Any) -> None:
        evict = getattr(cache, "evict_cached_blocks", None)
        if evict is None:
            return

        def counted() -> bool:
            before = self.cached_block_count()
            evicted = bool(evict())
            self.counters.evicted_blocks += max(0, before - self.cached_block_count())
            return evicted

        cache.evict_cached_blocks = counted


def _page_size(cache: Any) -> int:
    for allocator in getattr(cache, "cache_allocators", {}).values():
        return int(allocator.tokens_per_page)
    return 0


def configure(prefill_chunk_tokens: int) -> str:
    """Register a scheduler with these limits and return the name to put in
    `ContinuousBatchingConfig.scheduler_type` (transformers looks schedulers up by name in its
    `SCHEDULER_MAPPING` and instantiates the class in its generation thread)."""
    name = f"{SCHEDULER_NAME}:{prefill_chunk_tokens}"
    if name not in _cb_scheduler.SCHEDULER_MAPPING:
        class Configured(ShortFirstScheduler):
            pass

        Configured.prefill_chunk_tokens = prefill_chunk_tokens
        _cb_scheduler.SCHEDULER_MAPPING[name] = Configured
    return name
