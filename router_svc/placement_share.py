"""Placements shared between router processes: what one router just sent where, seen by the others
within milliseconds, before the engines' KV events could say it (docs/routing.md, "Several routers").

Every router of an admission pool publishes on one Redis pub/sub channel, ``tr:{pool}:placements``,
and subscribes to it. A message is one JSON object per event-loop iteration of the sender (records
are buffered by `PrefixIndex.on_record` and flushed by a `call_soon`, so a burst costs one PUBLISH,
never a round trip on the request's path):

    {"r": router id, "t": sender's wall clock, "f": {replica: this router's requests in flight there},
     "p": [[replica, kind, keys], ...], "h": [[replica, key], ...]}

`kind` is "p" (placed: pending until the events arrive, history on event-less replicas) or "f"
(finished: history only); `keys` is the prompt's chained block keys (`prefix_index.block_keys`:
Python's hash of int tuples from a blake2b salt root, the same in every process), packed as little-
endian int64 and base64-encoded (11 characters a block). A receiver enters them with
`PrefixIndex.remote`, exactly as its own placements (same expiry, less the record's age), and
ignores its own messages. `h` (when any) lists the holds this router made (`PrefixIndex.hold`: a request
ended there, its conversation's next turn is expected), each one packed key, entered with
`PrefixIndex.remote_hold`; a receiver that predates holds ignores the field. `f` is the sender's whole
in-flight vector (absolute counts, so a lost message costs nothing later): sent with every flush,
including one at the end of the loop iteration in which a request let go of its replica (`changed`, from
`EnginePool.release`), and by a ticker every `tick` s when it changed otherwise (or every `refresh` s
while non-zero); a vector older than `stale` s is ignored. Ends are sent at once because a
conversation's next turn follows its last within milliseconds, often through another router: a count the
ticker would send 0-50 ms later made that router see the conversation's own ended turn on its replica
and move the turn elsewhere (`shared-hot`, two routers: 25-32% of follow-up turns moved;
docs/routing.md). `remote_in_flight()` sums the other routers' vectors, which the prefix policy adds to
this router's own in-flight count (and clamps the engines' reported counts to:
`placement.cluster_view`); None while not subscribed.

Alone (one Redis, not a cluster): PUBLISH answers how many subscribers received the message. When
only this router heard its own message (1, or 0 while its subscription is down), and it has neither
subscribed nor heard another router for `stale` s, no other router is listening: the next flushes
are skipped (their records counted as `alone`) except one every `refresh` s, which probes again. A
message from another router ends it at once (its vector goes out in the same loop turn), and every
router publishes once as soon as it has subscribed, so a router that joins is heard at once. It lacks
the placements made while this one was alone (the engines' KV events still tell it what is cached
where). With `tokenrelay up`'s one router this takes the two PUBLISHes a request caused, and the two
own messages it read back, off its path. A router drops its own messages before parsing them (a
prefix check on the raw message).

Bounded and harmless: at most `max_buffer` records and `max_buffer_bytes` of keys wait for a flush
(more are dropped, oldest first, counted), at most `max_publishes` PUBLISHes are in flight (while
they are, records wait in the buffer).
Redis down or slow: publishes fail or wait and the subscriber reconnects with backoff; each router
then routes on its own view (logged once per 10 s, counted in tokenrelay_router_placement_share_total).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import json
import struct
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from redis.asyncio.cluster import RedisCluster

from services.logging import get_logger

from .cluster_redis import Pipeliner, Warned, subscribe
from .metrics_routing import PLACEMENT_SHARE, PLACEMENT_SHARE_SUBSCRIBED
from .prefix_index import PrefixIndex

log = get_logger(__name__)

_KINDS = {"placed": "p", "finished": "f"}
_NAMES = {v: k for k, v in _KINDS.items()}


def channel(pool: str) -> str:
    return f"tr:{{{pool}}}:placements"


def pack_keys(keys: Sequence[int]) -> str:
    return base64.b64encode(struct.pack(f"<{len(keys)}q", *keys)).decode()


def unpack_keys(text: str) -> tuple[int, ...]:
    raw = base64.b64decode(text, validate=True)
    if len(raw) % 8:
        raise ValueError("keys: not a whole number of int64")
    return struct.unpack(f"<{len(raw) // 8}q", raw)


class PlacementShare:
    """Publishes this router's placements and in-flight counts; enters the others' (module doc)."""

    def __init__(self, redis: Any, pipe: Pipeliner, pool: str, router_id: str, index: PrefixIndex | None,
                 in_flight: Callable[[], Mapping[str, int]], *, op_timeout: float = 1.0,
                 max_buffer: int = 4096, max_buffer_bytes: int = 4 << 20, max_publishes: int = 4,
                 tick: float = 0.05, refresh: float = 0.5, stale: float = 1.5) -> None:
        self.redis = redis
        self.pipe = pipe
        self.channel = channel(pool)
        self.router_id = router_id
        self.index = index
        self._in_flight = in_flight
        self.op_timeout = op_timeout
        self.max_buffer, self.max_buffer_bytes = max_buffer, max_buffer_bytes
        self.max_publishes = max_publishes
        self.tick, self.refresh, self.stale = tick, refresh, stale
        self._buffer: deque[list[Any]] = deque()
        self._holds: deque[list[str]] = deque(maxlen=max_buffer)
        self._buffered_bytes = 0
        self._scheduled = False
        self._publishing = 0
        self._sent_vector: dict[str, int] = {}
        self._sent_at = 0.0
        self._remote: dict[str, tuple[float, dict[str, int]]] = {}   # router → (received, vector)
        self._warn = Warned()
        self._tasks: list[asyncio.Task[None]] = []
        self.subscribed = asyncio.Event()    # set once first subscribed (tests)
        self._live = False
        self.received = 0     # remote records entered (tests)
        # No other router listens (module doc, "Alone"); never assumed for a cluster client, whose
        # PUBLISH counts the subscribers of one node only.
        self._alone = False
        self._quiet_since = 0.0     # subscribed, or last heard another router (monotonic)
        self._can_be_alone = not isinstance(redis, RedisCluster)
        own = json.dumps({"r": router_id}, separators=(",", ":"))[:-1] + ","
        self._own_prefix = (own, own.encode())

    # ------------------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        if self.index is not None:
            self.index.on_record = self.record
            self.index.on_hold = self.record_hold
        self._tasks = [asyncio.create_task(self._listen(), name="placement-share-listener"),
                       asyncio.create_task(self._ticker(), name="placement-share-ticker")]
        with contextlib.suppress(asyncio.TimeoutError):   # bounded: Redis down = serve on our own view
            await asyncio.wait_for(self.subscribed.wait(), self.op_timeout * 2)
        log.info("placement_share_joined", channel=self.channel, subscribed=self.subscribed.is_set())

    async def close(self) -> None:
        if self.index is not None and self.index.on_record == self.record:
            self.index.on_record = None
        if self.index is not None and self.index.on_hold == self.record_hold:
            self.index.on_hold = None
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks = []

    # ------------------------------------------------------------------------------ publishing
    def record(self, address: str, keys: list[int], kind: str) -> None:
        """`PrefixIndex.on_record`: buffer one record; flushed once this loop iteration ends."""
        packed = pack_keys(keys)
        self._buffer.append([address, _KINDS.get(kind, "p"), packed])
        self._buffered_bytes += len(packed)
        while len(self._buffer) > self.max_buffer or self._buffered_bytes > self.max_buffer_bytes:
            self._buffered_bytes -= len(self._buffer.popleft()[2])
            PLACEMENT_SHARE.labels("dropped").inc()
        self._schedule()

    def record_hold(self, address: str, key: int) -> None:
        """`PrefixIndex.on_hold`: buffer one hold (at most `max_buffer`, the oldest dropped)."""
        self._holds.append([address, pack_keys((key,))])
        self._schedule()

    def changed(self) -> None:
        """This router's in-flight count on a replica fell (a request let go of it): the vector goes
        out with this loop iteration's flush (one message for every end and placement in it)."""
        if self._live:
            self._schedule()

    def _schedule(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._scheduled = False
        if self._publishing >= self.max_publishes:
            return       # Redis is slow: the records wait (bounded); the next publish's end flushes them
        records, self._buffer, self._buffered_bytes = list(self._buffer), deque(), 0
        if self._alone and time.monotonic() - self._sent_at < self.refresh:
            if records:   # nobody to tell (module doc, "Alone")
                PLACEMENT_SHARE.labels("alone").inc(len(records))
            self._holds.clear()
            return
        vector = {a: n for a, n in self._in_flight().items() if n > 0}
        body: dict[str, Any] = {"r": self.router_id, "t": time.time(), "f": vector, "p": records}
        if self._holds:
            body["h"] = list(self._holds)
            self._holds.clear()
        message = json.dumps(body, separators=(",", ":"))
        self._sent_vector, self._sent_at = vector, time.monotonic()
        self._publishing += 1
        fut = self.pipe.submit("PUBLISH", self.channel, message)
        fut.add_done_callback(functools.partial(self._published, records=len(records), sent=self._sent_at))

    def _published(self, fut: asyncio.Future[Any], records: int, sent: float) -> None:
        self._publishing -= 1
        if fut.cancelled():
            return
        exc = fut.exception()
        if exc is not None:
            PLACEMENT_SHARE.labels("publish_failed").inc(max(records, 1))
            self._warn("placement_share_publish", exc)
        else:
            if records:
                PLACEMENT_SHARE.labels("sent").inc(records)
            heard_by = fut.result()
            # Not within `stale` s of subscribing or of hearing another router (one that is joining
            # may be subscribed without having been heard yet), nor when one was heard (or this router
            # subscribed again) since this PUBLISH went out: it subscribed after the count.
            if self._can_be_alone and isinstance(heard_by, int) and self._quiet_since <= sent:
                self._alone = heard_by <= 1 and time.monotonic() - self._quiet_since >= self.stale
        if self._buffer:
            self._schedule()

    async def _ticker(self) -> None:
        """The in-flight vector when it changed (a request ended), or while non-zero every `refresh` s."""
        while True:
            await asyncio.sleep(self.tick)
            vector = {a: n for a, n in self._in_flight().items() if n > 0}
            if vector != self._sent_vector or (vector and time.monotonic() - self._sent_at >= self.refresh):
                self._schedule()

    # ------------------------------------------------------------------------------ receiving
    async def _listen(self) -> None:
        backoff = 0.05
        while True:
            pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
            try:
                await asyncio.wait_for(subscribe(self.redis, pubsub, self.channel), self.op_timeout)
                self.subscribed.set()
                self._live = True
                # Heard by the routers already there: one that was alone starts sharing at once.
                self._alone = False
                self._quiet_since = time.monotonic()
                self._schedule()
                PLACEMENT_SHARE_SUBSCRIBED.set(1)
                backoff = 0.05
                while True:
                    message = await pubsub.get_message(timeout=1.0)
                    if message is not None and message.get("type") == "message":
                        self.on_message(message["data"])
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - Redis gone: our own view meanwhile, resubscribe
                self._warn("placement_share_subscribe", exc)
            finally:
                self._live = False
                PLACEMENT_SHARE_SUBSCRIBED.set(0)
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(pubsub.aclose(), self.op_timeout)
            self._remote.clear()      # nothing heard meanwhile: don't trust old counts
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 2.0)

    def on_message(self, data: bytes | str) -> None:
        if data.startswith(self._own_prefix[isinstance(data, bytes)]):    # type: ignore[arg-type]
            return   # its own, back from Redis
        try:
            message = json.loads(data)
            sender = str(message["r"])
            if sender == self.router_id:
                return
            age = min(max(0.0, time.time() - float(message["t"])), 60.0)
            vector = {str(a): int(n) for a, n in dict(message.get("f") or {}).items()}
            records = [(str(a), _NAMES[k], unpack_keys(keys)) for a, k, keys in message.get("p") or ()]
            holds = [(str(a), unpack_keys(key)) for a, key in message.get("h") or ()]
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            PLACEMENT_SHARE.labels("bad_message").inc()
            self._warn("placement_share_message", exc)
            return
        self._quiet_since = time.monotonic()
        self._remote[sender] = (self._quiet_since, vector)
        if self._alone:    # another router listens: tell it this one's vector (and what follows) now
            self._alone = False
            self._schedule()
        if self.index is None:
            return
        for address, kind, keys in records:
            self.index.remote(address, keys, kind, age)
        for address, keys in holds:
            for key in keys:
                self.index.remote_hold(address, key, age)
        if records:
            self.received += len(records)
            PLACEMENT_SHARE.labels("received").inc(len(records))

    @property
    def live(self) -> bool:
        """Subscribed now: what the other routers publish reaches this one."""
        return self._live

    def remote_in_flight(self) -> dict[str, int] | None:
        """Per replica, the other routers' requests in flight there (vectors heard within `stale` s);
        None while not subscribed (Redis down: this router's own view, the engines' reports)."""
        if not self._live:
            return None
        now = time.monotonic()
        out: dict[str, int] = {}
        for sender, (heard, vector) in list(self._remote.items()):
            if now - heard > self.stale:
                del self._remote[sender]
                continue
            for address, n in vector.items():
                out[address] = out.get(address, 0) + n
        return out
