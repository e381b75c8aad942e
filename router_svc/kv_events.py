"""KV-cache event feeds: one `SubscribeKvEvents` stream per engine replica into the `PrefixIndex`.

Each feed subscribes, learns from the first message whether the replica publishes events (and its
block size), then applies every event in order. A gap — an event id that does not follow the
previous one, or a batch reporting dropped events — clears the replica's entry and resubscribes:
tokenrelay's engines start every subscription with a snapshot of what they hold (stored events
with id 0), so the entry is rebuilt from the engine's own state, and a router started late knows
what a router started early knows. A broken stream (engine restarting) clears the entry too and
reconnects with backoff. A replica without events is served from routing history instead.

Routers subscribe independently; they see the same events in the same order, so their indexes,
and the choices made from them, agree (recent-placement entries aside, which last seconds).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterable
from typing import Any

import grpc

from services.logging import get_logger
from services.proto.tokenrelay.v1 import engine_pb2

from .metrics_routing import KV_EVENT_FEEDS, KV_EVENT_GAPS, KV_EVENTS
from .prefix_index import PrefixIndex, StoredBlock

log = get_logger(__name__)

_STORED, _REMOVED = engine_pb2.KV_EVENT_STORED, engine_pb2.KV_EVENT_REMOVED
_RETRY_FIRST, _RETRY_MAX = 0.25, 5.0
_NO_EVENTS_RECHECK = 60.0   # a replica without events is asked again this often (it may be replaced)


class _Gap(Exception):
    pass


class KvEventFeeds:
    """Keeps one feed task per replica address; `sync(addresses)` follows membership."""

    def __init__(self, index: PrefixIndex, stub_for: Callable[[str], Any]) -> None:
        self.index = index
        self._stub_for = stub_for
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self.state: dict[str, str] = {}
        self.live = asyncio.Event()   # set once some feed has applied its first message (tests)

    def sync(self, addresses: Iterable[str]) -> None:
        wanted = set(addresses)
        for address in list(self._tasks):
            if address not in wanted:
                self._tasks.pop(address).cancel()
                self.state.pop(address, None)
                self.index.forget(address)
        for address in wanted - set(self._tasks):
            self._tasks[address] = asyncio.create_task(self._feed(address), name=f"kv-events-{address}")
        self._gauge()

    def on_membership(self, added: Iterable[str], removed: Iterable[str]) -> None:
        """`EnginePool` listener: (added, removed) addresses."""
        self.sync((set(self._tasks) | set(added)) - set(removed))

    def _gauge(self) -> None:
        for state in ("live", "history", "down"):
            KV_EVENT_FEEDS.labels(state).set(sum(1 for s in self.state.values() if s == state))

    def _set(self, address: str, state: str) -> None:
        if self.state.get(address) != state:
            self.state[address] = state
            self._gauge()

    async def _feed(self, address: str) -> None:
        delay = _RETRY_FIRST
        self._set(address, "down")
        while True:
            try:
                enabled = await self._subscribe(address)
                if not enabled:
                    await asyncio.sleep(_NO_EVENTS_RECHECK)
                    continue
                delay = _RETRY_FIRST     # the stream ended cleanly (engine draining): reconnect soon
            except _Gap:
                KV_EVENT_GAPS.labels(address).inc()
                self.index.gap(address)
                log.warning("kv_events_gap", replica=address)
                delay = _RETRY_FIRST
                await asyncio.sleep(0.1)
                continue
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as exc:
                if self.state.get(address) != "down":
                    log.info("kv_events_down", replica=address, error=exc.code().name)
            except Exception as exc:  # noqa: BLE001 - a feed must never die; logged and retried
                log.warning("kv_events_failed", replica=address, error=repr(exc))
            self._set(address, "down")
            self.index.reset(address, events=True)   # nothing known until the next snapshot
            await asyncio.sleep(delay)
            delay = min(_RETRY_MAX, delay * 2)

    async def _subscribe(self, address: str) -> bool:
        call = self._stub_for(address).SubscribeKvEvents(engine_pb2.KvEventsRequest())
        try:
            first = True
            async for batch in call:
                if first:
                    first = False
                    info = batch.info
                    self.index.reset(address, events=info.enabled, tokens_per_block=info.tokens_per_block)
                    self._set(address, "live" if info.enabled else "history")
                    self.live.set()
                    if not info.enabled:
                        return False
                    log.info("kv_events_live", replica=address, tokens_per_block=info.tokens_per_block)
                if batch.dropped_events:
                    raise _Gap()
                self._apply(address, batch.events)
            return True
        finally:
            call.cancel()

    def _apply(self, address: str, events: Iterable[engine_pb2.KvCacheEvent]) -> None:
        index = self.index
        stored = removed = 0
        for e in events:
            if e.type == _STORED:
                ok = index.apply_stored(address, e.event_id, e.parent_hash if e.HasField("parent_hash") else None,
                                        [StoredBlock(b.block_hash, b.tokens) for b in e.blocks],
                                        e.cache_salt if e.HasField("cache_salt") else None)
                stored += 1
            elif e.type == _REMOVED:
                ok = index.apply_removed(address, e.event_id, e.block_hashes)
                removed += 1
            else:
                ok = index.skip(address, e.event_id)
            if not ok:
                raise _Gap()
        if stored:
            KV_EVENTS.labels("stored").inc(stored)
        if removed:
            KV_EVENTS.labels("removed").inc(removed)

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
