"""Redis plumbing of router_svc/cluster.py: the client factory (`open_redis`, from
services/redis_client.py: one Redis or, by a ``redis+cluster://`` URL, a Redis Cluster), one coalescing pipeline
per process (a round trip per batch of operations, keyed scripts merged into one call), bounded
task shutdown, and the counted, rate-limited log of fallbacks to local behaviour."""

from __future__ import annotations

import asyncio
import functools
import time
from typing import Any

from prometheus_client import Counter
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from services.logging import get_logger
from services.redis_client import RedisClient, is_cluster_url, open_redis

from .redis_scripts import ScriptClient

__all__ = ["REDIS_ERRORS", "Pipeliner", "RedisClient", "Warned", "consume", "is_cluster_url", "numsub",
           "open_redis", "stop_tasks", "subscribe"]

log = get_logger(__name__)

FALLBACKS = Counter("tokenrelay_router_cluster_fallbacks_total", "Cluster operations (request-id claim, "
                    "release, cancel, session) answered from this process's own view because Redis failed or "
                    "was slow", ["op"])


async def numsub(redis: RedisClient, channel: str) -> int:
    """Subscribers of `channel`. In a Redis Cluster, SUBSCRIBE and PUBSUB NUMSUB are node-local: ask
    the node of the channel's slot, where `pubsub()` subscribes and PUBLISH goes (redis-py would
    otherwise ask its default node, which may see no subscriber of a live router)."""
    if isinstance(redis, RedisCluster):
        counts = await redis.pubsub_numsub(channel, target_nodes=redis.get_node_from_key(channel))
    else:
        counts = await redis.pubsub_numsub(channel)
    return sum(int(n) for _, n in counts)


async def subscribe(redis: RedisClient, pubsub: Any, *channels: str) -> None:
    """Subscribe `pubsub` (made by ``redis.pubsub()``) to `channels`. A cluster client learns the
    slots first: its pubsub connects to the node of the channel's slot, which it looks up in them
    (redis-py fails with a KeyError while the client has sent no command yet)."""
    if isinstance(redis, RedisCluster):
        await redis.initialize()
    await pubsub.subscribe(*channels)


_Op = tuple[str, tuple[Any, ...], "asyncio.Future[Any]", str]  # command or script, args, future, key
LEAN_BATCHES = 4      # batches in flight at once on a lean connection (Pipeliner)


class Pipeliner:
    """One task sends every command submitted meanwhile as one pipeline (a round trip per batch).

    `call()` returns the command's reply, or raises RedisError within twice `timeout`.
    Keyed script operations (`submit_keyed`: a script over ``KEYS`` with the same ``ARGV``, one
    reply per key) of one batch become ONE script call over all their keys: a claim or a release
    costs Redis and redis-py one array element, not one command. Operations on one key run in the
    order they were submitted (a key met again starts new groups); a plain command goes in its
    place, before the groups still open (none of them touches a key its own process has grouped in
    the same batch: the take-over of an id and the Cancel's read come from requests not holding it here)."""

    def __init__(self, redis: RedisClient, timeout: float, lean: ScriptClient | None = None) -> None:
        self._redis = redis
        # With `lean` (router_svc/redis_scripts.py), a batch is written on that connection when its
        # turn comes, and the next does not wait for its replies while fewer than LEAN_BATCHES are in
        # flight (beyond them the operations wait and go out together, as with one redis-py pipeline
        # in flight: under load the batches grow instead of their number).
        self._lean = lean
        self._lean_batches = 0
        self._lean_room = asyncio.Event()
        self._timeout = timeout
        self._pending: list[_Op] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="cluster-redis-pipeline")

    def submit(self, command: str, *args: Any) -> asyncio.Future[Any]:
        return self._add(command, args, "")

    def submit_keyed(self, script: str, key: str, *args: Any) -> asyncio.Future[Any]:
        return self._add(script, args, key)

    def _add(self, what: str, args: tuple[Any, ...], key: str) -> asyncio.Future[Any]:
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        if self._lean is not None and not self._lean_batches and not self._pending and not self._closed:
            # Idle on a lean connection (no batch in flight, none waiting): written now, a batch of one,
            # rather than on the sender task's next turn (a request's id claim is on its first token's path).
            self._send_lean(self._plan([(what, args, fut, key)]))
            return fut
        self._pending.append((what, args, fut, key))
        self._wake.set()
        return fut

    async def call(self, command: str, *args: Any) -> Any:
        return await self._wait(self.submit(command, *args))

    async def call_keyed(self, script: str, key: str, *args: Any) -> Any:
        return await self._wait(self.submit_keyed(script, key, *args))

    @staticmethod
    async def _wait(fut: asyncio.Future[Any]) -> Any:
        # No timer per caller: every batch settles its futures within `timeout` (the pipeline's
        # wait_for), so a caller waits at most for the batch in flight and its own. A cancelled
        # caller cancels only its own future; the batch goes on and skips it.
        return await fut

    async def _run(self) -> None:
        while not self._closed:
            await self._wake.wait()
            self._wake.clear()
            if self._lean is not None:
                while self._lean_batches >= LEAN_BATCHES and not self._closed:
                    self._lean_room.clear()
                    await self._lean_room.wait()
            batch, self._pending = self._pending, []
            if batch:
                await self._send(batch)

    @staticmethod
    def _plan(batch: list[_Op]) -> list[tuple[tuple[Any, ...], list[asyncio.Future[Any]], bool]]:
        """The commands of a batch: per entry the command, its futures, and whether it is keyed."""
        entries: list[tuple[tuple[Any, ...], list[asyncio.Future[Any]], bool]] = []
        groups: dict[tuple[str, tuple[Any, ...]], tuple[list[str], list[asyncio.Future[Any]]]] = {}
        grouped: set[str] = set()   # the keys of `groups`

        def flush() -> None:
            for (script, args), (keys, futs) in groups.items():
                entries.append((("EVAL", script, len(keys), *keys, *args), futs, True))
            groups.clear()
            grouped.clear()
        for what, args, fut, key in batch:
            if not key:
                entries.append(((what, *args), [fut], False))
                continue
            # A key already grouped (a release of an id, then a new claim of it): the groups so
            # far go first, so each key's operations run in the order they were submitted.
            if key in grouped:
                flush()
            keys, futs = groups.setdefault((what, args), ([], []))
            keys.append(key)
            futs.append(fut)
            grouped.add(key)
        flush()
        return entries

    async def _send(self, batch: list[_Op]) -> None:
        entries = self._plan(batch)
        if self._lean is not None:
            self._send_lean(entries)
            return
        try:
            pipe = self._redis.pipeline(transaction=False)
            for command, _, _ in entries:
                pipe.execute_command(*command)
            replies = await asyncio.wait_for(pipe.execute(raise_on_error=False), self._timeout)
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            for *_, fut, _ in batch:
                if not fut.done():
                    fut.set_exception(RedisConnectionError(f"cluster store: {exc!r}"))
            return
        for (_, futs, keyed), reply in zip(entries, replies, strict=True):
            self._deliver(futs, keyed, reply)

    def _send_lean(self, entries: list[tuple[tuple[Any, ...], list[asyncio.Future[Any]], bool]]) -> None:
        assert self._lean is not None
        waiting = [fut for _, futs, _ in entries for fut in futs]
        left = [len(entries)]         # entries not answered yet
        counted = [True]              # the batch counts against LEAN_BATCHES
        self._lean_batches += 1

        def free() -> None:
            if counted[0]:
                counted[0] = False
                self._lean_batches -= 1
                self._lean_room.set()

        def expire() -> None:      # the batch's bound, as the pipeline's wait_for; its slot is free again
            for fut in waiting:
                if not fut.done():
                    fut.set_exception(RedisConnectionError(f"cluster store: no reply in {self._timeout:.1f}s"))
            free()
        timer = asyncio.get_running_loop().call_later(self._timeout, expire)

        def answered(op: asyncio.Future[Any], futs: list[asyncio.Future[Any]], keyed: bool) -> None:
            left[0] -= 1
            if left[0] == 0:
                timer.cancel()
                free()
            if op.cancelled():
                reply: Any = RedisConnectionError("cluster store: cancelled")
            else:
                reply = op.exception()
                if isinstance(reply, (RedisConnectionError, OSError)):
                    reply = RedisConnectionError(f"cluster store: {reply}")
                elif reply is None:
                    reply = op.result()
            self._deliver(futs, keyed, reply)
        for command, futs, keyed in entries:
            self._lean.command(*command).add_done_callback(functools.partial(answered, futs=futs, keyed=keyed))

    @staticmethod
    def _deliver(futs: list[asyncio.Future[Any]], keyed: bool, reply: Any) -> None:
        for i, fut in enumerate(futs):
            if fut.done():
                continue
            if isinstance(reply, Exception):
                fut.set_exception(reply)
            elif not keyed:
                fut.set_result(reply)
            elif isinstance(reply, list) and i < len(reply):
                fut.set_result(reply[i])
            else:
                fut.set_exception(RedisError(f"keyed script replied {reply!r}"))

    async def close(self) -> None:
        self._closed = True
        self._wake.set()
        self._lean_room.set()
        if self._task is not None:
            await stop_tasks([self._task], self._timeout * 2)
        for *_, fut, _ in self._pending:
            if not fut.done():
                fut.set_exception(RedisConnectionError("closed"))
                fut.add_done_callback(consume)


async def stop_tasks(tasks: list[asyncio.Task[None]], timeout: float) -> None:
    """Cancel and wait, bounded: Python 3.11's wait_for can swallow a cancel that lands as its inner
    call completes, and a close must never hang on it."""
    for task in tasks:
        task.cancel()
    done, pending = await asyncio.wait(tasks, timeout=timeout)
    for task in done:
        if not task.cancelled() and task.exception() is not None:
            log.warning("cluster_task_failed", task=task.get_name(), error=repr(task.exception()))
    for task in pending:
        task.cancel()  # once more; it ends at its next await
        log.warning("cluster_task_slow_to_stop", task=task.get_name())


def consume(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()


class Warned:
    """Log a Redis fallback once per op per 10 s (it can happen per request), count every one."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}

    def __call__(self, op: str, exc: BaseException) -> None:
        FALLBACKS.labels(op).inc()
        now = time.monotonic()
        if now - self._last.get(op, -1e9) > 10:
            self._last[op] = now
            log.warning("cluster_redis_fallback", op=op, error=repr(exc))


REDIS_ERRORS = (RedisError, OSError, asyncio.TimeoutError)
