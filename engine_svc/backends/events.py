"""What an engine reports besides tokens: its health, its per-iteration stats and its KV-cache events.

These are the contract's optional parts (issue 13). Production engines expose them (TensorRT-LLM's
`get_stats_async` / `get_kv_cache_events_async`); the router uses them for load-aware and
prefix-aware placement. Domain types only: no grpc, no protobuf.

KV events follow TensorRT-LLM's schema: ``stored`` (a chain of new full blocks under
``parent_hash``, each with its hash and token ids), ``removed`` (block hashes evicted), ``created``
(the cache came up, blocks per cache level) and ``updated`` (a block changed cache level or
priority). ``event_id`` grows by one per event, so a subscriber sees a gap when it lost some.

`KvEventHub` fans a backend's events out to any number of subscribers, each with a bounded buffer:
a subscriber that falls behind loses its oldest events and is told how many (``dropped``), so a
slow router can never make the engine's memory grow.
"""

from __future__ import annotations

import asyncio
import enum
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass


class HealthState(enum.Enum):
    SERVING = "serving"      # accepting requests
    DRAINING = "draining"    # finishing what it has, refusing new requests (shutdown)
    DEAD = "dead"            # the engine failed: nothing it holds will finish; restart the process
    # The engine server a remote backend reaches (trtllm-grpc, triton) does not answer: what it held
    # was failed (retryable) and new work is refused, as for DEAD, but the backend keeps probing and
    # returns to SERVING by itself when the server answers again (a restarted server, a network cut).
    UNAVAILABLE = "unavailable"


@dataclass(frozen=True, slots=True)
class IterationStats:
    """The engine's latest iteration (TensorRT-LLM's `get_stats` item, in the contract's names).

    ``kv_blocks_reused`` / ``kv_blocks_missed`` count full prompt blocks found / not found in the
    cache since the engine started; ``kv_cache_hit_rate`` is reused / (reused + missed)."""

    iteration: int = 0
    active: int = 0
    queued: int = 0
    max_active: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    kv_blocks_free: int = 0
    kv_blocks_reused: int = 0
    kv_blocks_missed: int = 0
    kv_cache_hit_rate: float = 0.0
    tokens_per_block: int = 0
    context_requests: int = 0            # requests in their prefill (context) phase this iteration
    generation_requests: int = 0         # requests decoding this iteration
    paused_requests: int = 0
    iteration_latency_ms: float = 0.0


def hit_rate(reused: int, missed: int) -> float:
    lookups = reused + missed
    return reused / lookups if lookups else 0.0


class KvEventType(enum.Enum):
    CREATED = "created"
    STORED = "stored"
    REMOVED = "removed"
    UPDATED = "updated"


@dataclass(frozen=True, slots=True)
class KvBlock:
    """One full block of a ``stored`` (or ``updated``) event."""

    block_hash: int
    token_ids: tuple[int, ...] = ()
    cache_level: int = 0                 # 0 = GPU, 1 = host (offloaded)
    priority: int = 0                    # the engine's retention priority (0 = unspecified)


@dataclass(frozen=True, slots=True)
class KvEvent:
    event_id: int
    type: KvEventType
    parent_hash: int | None = None       # stored: the block the first new block hangs from
    blocks: tuple[KvBlock, ...] = ()     # stored / updated
    block_hashes: tuple[int, ...] = ()   # removed
    window_size: int = 0                 # attention window of the pool (0 = the model's full context)
    num_blocks_per_cache_level: tuple[int, ...] = ()   # created
    cache_salt: str | None = None        # stored: the salt of the blocks (None: the engine does not say)


SNAPSHOT_CHUNK = 1024     # snapshot events per batch


class KvEventSubscription:
    """One subscriber's bounded buffer. Iterate it for ``(events, dropped)`` batches: every event
    published since the previous batch, and how many were lost because the buffer was full.
    Iteration ends when the hub closes (engine stopped or dead) or `close()` is called."""

    def __init__(self, hub: KvEventHub, capacity: int) -> None:
        self._hub = hub
        self._buffer: deque[KvEvent] = deque(maxlen=capacity)
        self._dropped = 0
        self._ready = asyncio.Event()
        self.closed = False
        self._snapshot: list[KvEvent] = []

    def offer_snapshot(self, events: list[KvEvent]) -> None:
        """What the cache holds at subscription time (``stored`` events with event id 0), sent before
        anything live and outside the bounded buffer, so a new subscriber starts complete."""
        self._snapshot = events
        if events:
            self._ready.set()

    def _offer(self, events: list[KvEvent]) -> None:
        overflow = len(self._buffer) + len(events) - (self._buffer.maxlen or 0)
        if overflow > 0:
            self._dropped += overflow
        self._buffer.extend(events)
        self._ready.set()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._hub._subscribers.discard(self)
            self._ready.set()

    def take(self) -> tuple[list[KvEvent], int]:
        """Everything buffered now, without waiting."""
        events, dropped = list(self._buffer), self._dropped
        self._buffer.clear()
        self._dropped = 0
        return events, dropped

    def __aiter__(self) -> AsyncIterator[tuple[list[KvEvent], int]]:
        return self._batches()

    async def _batches(self) -> AsyncIterator[tuple[list[KvEvent], int]]:
        while True:
            await self._ready.wait()
            self._ready.clear()
            while self._snapshot:
                chunk, self._snapshot = self._snapshot[:SNAPSHOT_CHUNK], self._snapshot[SNAPSHOT_CHUNK:]
                yield chunk, 0
            events, dropped = self.take()
            if events or dropped:
                yield events, dropped
            if self.closed:
                return


class KvEventHub:
    """Fan-out of one backend's KV events (publish on the event loop; O(subscribers) per batch)."""

    def __init__(self, capacity: int = 16_384) -> None:
        self.capacity = capacity
        self._subscribers: set[KvEventSubscription] = set()
        self.published = 0
        self.closed = False

    @property
    def subscribers(self) -> int:
        return len(self._subscribers)

    def subscribe(self) -> KvEventSubscription:
        sub = KvEventSubscription(self, self.capacity)
        if self.closed:
            sub.close()
        else:
            self._subscribers.add(sub)
        return sub

    def publish(self, events: list[KvEvent]) -> None:
        if not events:
            return
        self.published += len(events)
        for sub in self._subscribers:
            sub._offer(events)

    def close(self) -> None:
        """End every subscription (their iterators finish after what is buffered)."""
        self.closed = True
        self.end_subscriptions()

    def end_subscriptions(self) -> None:
        """End the current subscriptions but take new ones (the engine went unavailable: what the
        subscribers know of its cache is void; they subscribe again once it serves)."""
        for sub in list(self._subscribers):
            sub.close()
