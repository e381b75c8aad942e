"""The KV-event feed's protocol logic against a scripted stub: a gap in event ids or a batch with
dropped events clears the replica and resubscribes (the new subscription's snapshot rebuilds it);
a replica without events falls back to routing history."""

from __future__ import annotations

import asyncio

from router_svc.kv_events import KvEventFeeds
from router_svc.prefix_index import PrefixIndex, block_keys
from services.proto.tokenrelay.v1 import engine_pb2
from tests.waiting import poll

TPB = 4
PROMPT = list(range(1, 14))


def _info(enabled: bool = True) -> engine_pb2.KvEventBatch:
    return engine_pb2.KvEventBatch(info=engine_pb2.KvEventsInfo(enabled=enabled, tokens_per_block=TPB))


def _stored(event_id: int, tokens: list[int], first_hash: int, parent: int | None = None) -> engine_pb2.KvCacheEvent:
    blocks = [engine_pb2.KvBlock(block_hash=first_hash + i, tokens=tokens[i * TPB:(i + 1) * TPB])
              for i in range(len(tokens) // TPB)]
    e = engine_pb2.KvCacheEvent(event_id=event_id, type=engine_pb2.KV_EVENT_STORED, blocks=blocks, cache_salt="t")
    if parent is not None:
        e.parent_hash = parent
    return e


class _Call:
    def __init__(self, batches: list[engine_pb2.KvEventBatch], hold: asyncio.Event) -> None:
        self._batches, self._hold = batches, hold

    def __aiter__(self) -> _Call:
        return self

    async def __anext__(self) -> engine_pb2.KvEventBatch:
        if self._batches:
            return self._batches.pop(0)
        await self._hold.wait()      # the stream stays open
        raise StopAsyncIteration

    def cancel(self) -> None:
        self._hold.set()


class _Stub:
    def __init__(self, *subscriptions: list[engine_pb2.KvEventBatch]) -> None:
        self.subscriptions = list(subscriptions)
        self.calls = 0

    def SubscribeKvEvents(self, request: object) -> _Call:
        self.calls += 1
        return _Call(self.subscriptions.pop(0) if self.subscriptions else [], asyncio.Event())


def _depth(index: PrefixIndex) -> int:
    return index.match(PROMPT, ["e"], "t").get("e", 0)


async def test_a_gap_clears_the_replica_and_the_next_snapshot_rebuilds_it() -> None:
    index = PrefixIndex(TPB, pending_ttl=0)
    stub = _Stub(
        [_info(), engine_pb2.KvEventBatch(events=[_stored(5, PROMPT[:8], 100)]),
         engine_pb2.KvEventBatch(events=[_stored(7, PROMPT[8:12], 200, parent=101)])],     # 6 is missing
        [_info(), engine_pb2.KvEventBatch(events=[_stored(0, PROMPT[:12], 300)])])         # snapshot
    feeds = KvEventFeeds(index, lambda _address: stub)
    feeds.sync(["e"])
    try:
        await poll(lambda: stub.calls == 2 and _depth(index) == 3, timeout=5, what="resubscribed and rebuilt")
        assert index.stats("e")["gaps"] >= 1
        assert feeds.state["e"] == "live"
    finally:
        await feeds.close()


async def test_dropped_events_count_as_a_gap() -> None:
    index = PrefixIndex(TPB, pending_ttl=0)
    stub = _Stub([_info(), engine_pb2.KvEventBatch(events=[_stored(1, PROMPT[:8], 100)]),
                  engine_pb2.KvEventBatch(dropped_events=3)],
                 [_info()])
    feeds = KvEventFeeds(index, lambda _address: stub)
    feeds.sync(["e"])
    try:
        await poll(lambda: stub.calls == 2 and feeds.state.get("e") == "live", timeout=5, what="resubscribed")
        assert _depth(index) == 0      # nothing known until the new subscription's snapshot says so
    finally:
        await feeds.close()


async def test_a_replica_without_events_is_served_from_routing_history() -> None:
    index = PrefixIndex(TPB, pending_ttl=0)
    stub = _Stub([_info(enabled=False)])
    feeds = KvEventFeeds(index, lambda _address: stub)
    feeds.sync(["e"])
    try:
        await poll(lambda: feeds.state.get("e") == "history", timeout=5, what="history mode")
        index.placed("e", PROMPT, "t")
        assert _depth(index) == len(block_keys(PROMPT[:12], TPB))
        feeds.sync([])                  # removed from the pool: forgotten
        assert _depth(index) == 0
    finally:
        await feeds.close()
