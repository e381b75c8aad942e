"""Redis plumbing of router_svc/cluster.py: a client with bounded timeouts, one coalescing pipeline
per process (a round trip per batch of operations, keyed scripts merged into one call), bounded
task shutdown, and the counted, rate-limited log of fallbacks to local behaviour."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import redis.asyncio as aioredis
from prometheus_client import Counter
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from services.logging import get_logger

log = get_logger(__name__)

FALLBACKS = Counter("tokenrelay_router_cluster_fallbacks_total", "Cluster operations (request-id claim, "
                    "release, cancel, session) answered from this process's own view because Redis failed or "
                    "was slow", ["op"])

def open_redis(url: str, timeout: float, **options: Any) -> aioredis.Redis:
    """A client for cluster state: bounded timeouts, and one retry on a fresh connection when a
    pooled one turns out dead (after a Redis restart), so no operation is lost to a stale socket.
    ``options``: TLS files and password (`AdmissionSettings.redis_options`, as the admission pool)."""
    return aioredis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout, health_check_interval=30,
                             retry=Retry(NoBackoff(), 1),
                             retry_on_error=[RedisConnectionError, RedisTimeoutError, ConnectionResetError],
                             **options)


_Op = tuple[str, tuple[Any, ...], "asyncio.Future[Any]", str]  # command or script, args, future, key


class Pipeliner:
    """One task sends every command submitted meanwhile as one pipeline (a round trip per batch).

    `call()` returns the command's reply, or raises RedisError within twice `timeout`.
    Keyed script operations (`submit_keyed`: a script over ``KEYS`` with the same ``ARGV``, one
    reply per key) of one batch become ONE script call over all their keys: a claim or a release
    costs Redis and redis-py one array element, not one command."""

    def __init__(self, redis: aioredis.Redis, timeout: float) -> None:
        self._redis = redis
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
            batch, self._pending = self._pending, []
            if batch:
                await self._send(batch)

    async def _send(self, batch: list[_Op]) -> None:
        entries: list[tuple[list[asyncio.Future[Any]], bool]] = []  # per pipeline entry: futures, keyed
        groups: dict[tuple[str, tuple[Any, ...]], tuple[list[str], list[asyncio.Future[Any]]]] = {}
        try:
            pipe = self._redis.pipeline(transaction=False)
            for what, args, fut, key in batch:
                if not key:
                    pipe.execute_command(what, *args)
                    entries.append(([fut], False))
                    continue
                keys, futs = groups.setdefault((what, args), ([], []))
                keys.append(key)
                futs.append(fut)
            for (script, args), (keys, futs) in groups.items():
                pipe.execute_command("EVAL", script, len(keys), *keys, *args)
                entries.append((futs, True))
            replies = await asyncio.wait_for(pipe.execute(raise_on_error=False), self._timeout)
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            for *_, fut, _ in batch:
                if not fut.done():
                    fut.set_exception(RedisConnectionError(f"cluster store: {exc!r}"))
            return
        for (futs, keyed), reply in zip(entries, replies, strict=True):
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
