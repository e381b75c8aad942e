"""Gather the inputs of concurrent calls into batches and run them on a bounded thread pool.

Callers `submit` a job of some size (for the tokenizer: a call and its number of inputs) and
await its result. One dispatcher task takes jobs off the queue only when a worker is free, so
under load the jobs that arrive meanwhile are batched together (up to `max_batch` in size),
while an idle service runs a lone job immediately. The batch function runs in a worker thread
(for the tokenizer: `encode_batch`, which releases the GIL) and returns, per job, its result or
the exception for that job alone.

An optional second stage, `post`, takes the batch function's output and makes the per-job
results on a thread of its own, so a worker is free for the next batch as soon as the batch
function returns: for the tokenizer, the Python work per id (reading ids, packing responses)
runs while the library already encodes the next batch, instead of leaving its cores idle.

With `overlap_after` > 0 the batch function is taken to use every core by itself (the tokenizers
library's thread pool): batches then run one after another, each taking all that is queued, and
a second one may start only once the running one has run `overlap_after` seconds, which means it
is held up by a long input while the pool's other threads idle. Batches that start together also
end together, and the cores then wait for the next calls to arrive; one at a time, the next
batch is always queued behind the running one.

Pending work is bounded: a job that would take the size of
queued + running work past `max_pending` is rejected with `Reason.OVERLOADED` (UNAVAILABLE)
instead of growing the queue.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from services.errors import Reason, TokenrelayError
from services.logging import get_logger

log = get_logger(__name__)

J = TypeVar("J")
R = TypeVar("R")

BatchFn = Callable[[list[J]], Any]   # per-job results, or (with `post`) whatever post takes
PostFn = Callable[[list[J], Any], Sequence["R | BaseException"]]


@dataclass(eq=False)
class _Job(Generic[J, R]):
    job: J
    size: int
    future: asyncio.Future[R] = field(repr=False)


class Batcher(Generic[J, R]):
    def __init__(self, process: BatchFn[J], *, workers: int, max_batch: int, max_pending: int,
                 name: str = "batcher", post: PostFn[J, R] | None = None, overlap_after: float = 0.0) -> None:
        if workers < 1 or max_batch < 1 or max_pending < 1:
            raise ValueError("workers, max_batch and max_pending must be >= 1")
        self._process = process
        self._post = post
        self._overlap_after = overlap_after
        self._started: dict[int, float] = {}   # running batches (by id) -> loop time they started
        self._ended = asyncio.Event()
        self._post_executor: concurrent.futures.ThreadPoolExecutor | None = None
        self.workers = workers
        self.max_batch = max_batch
        self.max_pending = max_pending
        self._name = name
        self._queue: asyncio.Queue[_Job[J, R]] = asyncio.Queue()
        self._pending = 0
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._slots: asyncio.Semaphore | None = None
        self._dispatcher: asyncio.Task[None] | None = None
        self.batches_run = 0          # for tests and metrics: how many batch calls were made

    @property
    def pending(self) -> int:
        return self._pending

    async def start(self) -> None:
        self._executor = concurrent.futures.ThreadPoolExecutor(self.workers, thread_name_prefix=self._name)
        if self._post is not None:
            self._post_executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"{self._name}-post")
        self._slots = asyncio.Semaphore(self.workers)
        self._idle = self.workers
        self._dispatcher = asyncio.create_task(self._dispatch(), name=f"{self._name}-dispatch")

    async def close(self) -> None:
        if self._dispatcher is not None:
            self._dispatcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._dispatcher
            self._dispatcher = None
        while not self._queue.empty():
            _fail([self._queue.get_nowait()], shutting_down())
        for executor in (self._executor, self._post_executor):
            if executor is not None:
                # Running batches finish in their threads; nobody waits for them any more.
                executor.shutdown(wait=False, cancel_futures=True)
        self._executor = self._post_executor = None

    async def submit(self, job: J, size: int = 1, inline: bool = False) -> R:
        """The job's result. ``inline``: the caller says the job is small; when nothing is queued
        or running, it is then run right here on the event loop (no hand-off to the worker and
        post threads and back: their wake-ups cost more than a small job's work)."""
        if self._dispatcher is None:
            raise Reason.SHUTTING_DOWN.error("tokenizer is not running")
        if self._pending + size > self.max_pending:
            raise Reason.OVERLOADED.error(f"tokenizer overloaded: {self._pending} inputs pending")
        if inline:
            ran = self.run_now(job, size)
            if ran is not None:
                return ran[0]
        entry: _Job[J, R] = _Job(job, size, asyncio.get_running_loop().create_future())
        self._pending += size
        self._queue.put_nowait(entry)
        try:
            return await entry.future
        finally:
            if not entry.future.done():
                # The caller went away: the dispatcher will skip this job.
                entry.future.cancel()

    def run_now(self, job: J, size: int = 1) -> tuple[R] | None:
        """`submit(job, inline=True)` when that would run the job here: its result (in a 1-tuple);
        None when the batcher is busy or not running (then `submit` it)."""
        if self._dispatcher is None or self._pending or self._idle != self.workers:
            return None
        return (self._run_inline(job, size),)

    def _run_inline(self, job: J, size: int) -> R:
        self._pending += size
        try:
            staged = self._run([job])
            results = self._run_post([job], staged) if self._post is not None else staged
        except Exception as exc:
            log.error("batch_failed", batcher=self._name, error=repr(exc))
            raise
        finally:
            self._pending -= size
            self.batches_run += 1
        result = results[0]
        if isinstance(result, BaseException):
            raise result
        return result  # type: ignore[no-any-return]

    async def _dispatch(self) -> None:
        assert self._slots is not None
        loop = asyncio.get_running_loop()
        while True:
            await self._slots.acquire()
            first = await self._queue.get()
            try:
                await self._stagger()
            except asyncio.CancelledError:   # closing: the job taken off the queue must not hang
                _fail([first], shutting_down())
                raise
            batch = self._take(first)
            if not batch:
                self._slots.release()
                continue
            self._idle -= 1
            self._started[id(batch)] = loop.time()
            run = loop.run_in_executor(self._executor, self._run, [entry.job for entry in batch])
            run.add_done_callback(lambda f, b=batch: self._finish(b, f))  # type: ignore[misc]

    async def _stagger(self) -> None:
        """With `overlap_after`: wait until no batch runs, or the youngest has run that long."""
        loop = asyncio.get_running_loop()
        while self._overlap_after > 0 and self._started:
            wait = max(self._started.values()) + self._overlap_after - loop.time()
            if wait <= 0:
                return
            self._ended.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._ended.wait(), wait)

    def _take(self, first: _Job[J, R]) -> list[_Job[J, R]]:
        """The first job plus whatever else is queued, up to max_batch in size; cancelled jobs dropped."""
        batch: list[_Job[J, R]] = []
        size = 0
        # Leave work for idle workers: split what is queued evenly over this worker and the idle ones
        # (with the library's own thread pool off, a worker thread is the unit of parallelism).
        jobs = -(-(self._queue.qsize() + 1) // max(1, self._idle)) if self._overlap_after <= 0 else self.max_batch
        entry: _Job[J, R] | None = first
        while entry is not None:
            if entry.future.done():
                self._pending -= entry.size
            else:
                batch.append(entry)
                size += entry.size
            more = size < self.max_batch and len(batch) < jobs and not self._queue.empty()
            entry = self._queue.get_nowait() if more else None
        return batch

    def _run(self, jobs: list[J]) -> Any:
        results = self._process(jobs)
        if self._post is None:
            _check_count(results, jobs)
        return results

    def _run_post(self, jobs: list[J], staged: Any) -> Sequence[R | BaseException]:
        assert self._post is not None
        results = self._post(jobs, staged)
        _check_count(results, jobs)
        return results

    def _finish(self, batch: list[_Job[J, R]], run: asyncio.Future[Any]) -> None:
        """The batch function returned: free its worker, then resolve (or hand to `post`)."""
        assert self._slots is not None
        self._slots.release()
        self._idle += 1
        self.batches_run += 1
        self._started.pop(id(batch), None)
        self._ended.set()
        if self._post is None or run.cancelled() or run.exception() is not None:
            self._resolve(batch, run)
            return
        if self._post_executor is None:   # closed while the batch ran: its output has nowhere to go
            self._pending -= sum(entry.size for entry in batch)
            _fail(batch, shutting_down())
            return
        post = asyncio.get_running_loop().run_in_executor(
            self._post_executor, self._run_post, [entry.job for entry in batch], run.result())
        post.add_done_callback(lambda f, b=batch: self._resolve(b, f))  # type: ignore[misc]

    def _resolve(self, batch: list[_Job[J, R]], run: asyncio.Future[Any]) -> None:
        self._pending -= sum(entry.size for entry in batch)
        error = None if run.cancelled() else run.exception()
        if run.cancelled() or error is not None:
            log.error("batch_failed", batcher=self._name, error=repr(error))
            _fail(batch, error or shutting_down())
            return
        for entry, result in zip(batch, run.result(), strict=True):
            if entry.future.done():
                continue
            if isinstance(result, BaseException):
                entry.future.set_exception(result)
            else:
                entry.future.set_result(result)


def shutting_down() -> TokenrelayError:
    return Reason.SHUTTING_DOWN.error("tokenizer is shutting down")


def _fail(batch: Sequence[_Job[Any, Any]], error: BaseException) -> None:
    """Every job of `batch` still waiting gets `error`."""
    for entry in batch:
        if not entry.future.done():
            entry.future.set_exception(error)


def _check_count(results: Sequence[Any], jobs: list[Any]) -> None:
    if len(results) != len(jobs):
        raise RuntimeError(f"batch function returned {len(results)} results for {len(jobs)} jobs")
