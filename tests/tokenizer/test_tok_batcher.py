"""The batcher: batching under load, bounded pending work, per-job errors, cancellation, close."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import pytest

from services.errors import InvalidArgument, Unavailable
from services.tokenization.batcher import Batcher
from tests.waiting import poll


class Gate:
    """A batch function that records its batches and can be held closed to build up load."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.open.set()
        self.entered = threading.Event()
        self.batches: list[list[list[str]]] = []

    def __call__(self, jobs: list[list[str]]) -> list[list[str] | BaseException]:
        self.batches.append(jobs)
        self.entered.set()
        self.open.wait(10)
        return [InvalidArgument("bad", "BAD_ITEM") if "bad" in job else [s.upper() for s in job] for job in jobs]


@contextlib.asynccontextmanager
async def held_batcher(**options):  # type: ignore[no-untyped-def]
    """A started batcher over a closed Gate, so jobs pile up; opened and closed however the test ends."""
    gate = Gate()
    gate.open.clear()
    batcher: Batcher[list[str], list[str]] = Batcher(gate, **{"max_pending": 100, **options})
    await batcher.start()
    try:
        yield gate, batcher
    finally:
        gate.open.set()
        await batcher.close()


async def test_jobs_arriving_while_busy_are_batched_together() -> None:
    async with held_batcher(workers=1, max_batch=100, max_pending=1000) as (gate, batcher):
        first = asyncio.create_task(batcher.submit(["a"], 1))
        await poll(gate.entered.is_set)
        rest = [asyncio.create_task(batcher.submit([f"x{i}", f"y{i}"], 2)) for i in range(10)]
        await poll(lambda: batcher.pending == 21)
        gate.open.set()
        assert await first == ["A"]
        assert await asyncio.gather(*rest) == [[f"X{i}", f"Y{i}"] for i in range(10)]
        # The ten jobs queued behind the first ran as one batch.
        assert [len(b) for b in gate.batches] == [1, 10]
        assert batcher.pending == 0


async def test_max_batch_splits_batches() -> None:
    async with held_batcher(workers=1, max_batch=4, max_pending=1000) as (gate, batcher):
        first = asyncio.create_task(batcher.submit(["a"], 1))
        await poll(gate.entered.is_set)
        rest = [asyncio.create_task(batcher.submit([str(i)], 1)) for i in range(10)]
        await poll(lambda: batcher.pending == 11)
        gate.open.set()
        await asyncio.gather(first, *rest)
        assert [len(b) for b in gate.batches] == [1, 4, 4, 2]


async def test_overload_is_rejected_not_queued() -> None:
    async with held_batcher(workers=1, max_batch=8, max_pending=3) as (gate, batcher):
        held = asyncio.create_task(batcher.submit(["a", "b"], 2))
        await poll(gate.entered.is_set)
        with pytest.raises(Unavailable) as info:
            await batcher.submit(["c", "d"], 2)
        assert info.value.reason == "OVERLOADED"
        ok = asyncio.create_task(batcher.submit(["c"], 1))   # exactly at the limit is fine
        await poll(lambda: batcher.pending == 3)
        gate.open.set()
        assert await held == ["A", "B"] and await ok == ["C"]


async def test_one_bad_job_does_not_fail_its_batch_mates() -> None:
    async with held_batcher(workers=1, max_batch=8) as (gate, batcher):
        first = asyncio.create_task(batcher.submit(["a"], 1))
        await poll(gate.entered.is_set)
        good = asyncio.create_task(batcher.submit(["ok"], 1))
        bad = asyncio.create_task(batcher.submit(["bad"], 1))
        await poll(lambda: batcher.pending == 3)
        gate.open.set()
        assert await first == ["A"] and await good == ["OK"]
        with pytest.raises(InvalidArgument):
            await bad


async def test_cancelled_jobs_are_skipped_and_released() -> None:
    async with held_batcher(workers=1, max_batch=8) as (gate, batcher):
        first = asyncio.create_task(batcher.submit(["a"], 1))
        await poll(gate.entered.is_set)
        gone = asyncio.create_task(batcher.submit(["gone"], 1))
        await poll(lambda: batcher.pending == 2)
        gone.cancel()
        kept = asyncio.create_task(batcher.submit(["kept"], 1))
        gate.open.set()
        assert await first == ["A"] and await kept == ["KEPT"]
        assert all(["gone"] not in batch for batch in gate.batches)
        await poll(lambda: batcher.pending == 0)


async def test_unexpected_failure_reaches_every_caller_and_close_rejects() -> None:
    def broken(jobs: list[list[str]]) -> list[list[str] | BaseException]:
        raise RuntimeError("boom")

    batcher: Batcher[list[str], list[str]] = Batcher(broken, workers=2, max_batch=8, max_pending=100)
    await batcher.start()
    results = await asyncio.gather(batcher.submit(["a"], 1), batcher.submit(["b"], 1), return_exceptions=True)
    assert all(isinstance(r, RuntimeError) for r in results)
    await batcher.close()
    with pytest.raises(Unavailable):
        await batcher.submit(["late"], 1)


async def test_post_stage_frees_the_worker_for_the_next_batch() -> None:
    post_open = threading.Event()
    log: list[tuple[str, list[str]]] = []

    def process(jobs: list[str]) -> list[str]:
        log.append(("process", list(jobs)))
        return [job.upper() for job in jobs]

    def post(jobs: list[str], staged: list[str]) -> list[str | BaseException]:
        log.append(("post", list(jobs)))
        post_open.wait(10)
        return [InvalidArgument("bad", "BAD_ITEM") if s == "BAD" else s + "!" for s in staged]

    batcher: Batcher[str, str] = Batcher(process, post=post, workers=1, max_batch=8, max_pending=100)
    await batcher.start()
    try:
        first = asyncio.create_task(batcher.submit("a"))
        await poll(lambda: ("post", ["a"]) in log)        # a's results are held in post
        second = asyncio.create_task(batcher.submit("b"))
        bad = asyncio.create_task(batcher.submit("bad"))
        # The one worker took the next batches while the first one's post stage is still held.
        await poll(lambda: sum(len(jobs) for kind, jobs in log if kind == "process") == 3)
        assert batcher.pending == 3
        post_open.set()
        assert await first == "A!" and await second == "B!"
        with pytest.raises(InvalidArgument):
            await bad
        await poll(lambda: batcher.pending == 0)
    finally:
        post_open.set()
        await batcher.close()


async def test_overlap_after_holds_a_second_batch_until_the_first_has_run_that_long() -> None:
    loop = asyncio.get_running_loop()
    async with held_batcher(workers=2, max_batch=100, overlap_after=0.3) as (gate, batcher):
        first = asyncio.create_task(batcher.submit(["a"], 1))
        await poll(gate.entered.is_set)
        started = loop.time()
        rest = [asyncio.create_task(batcher.submit([f"x{i}"], 1)) for i in range(3)]
        await poll(lambda: len(gate.batches) == 2)
        # Held back while the first batch had run less than 0.3 s, then started beside it (the
        # first is still held: it stands for a batch stuck on one long input), taking all that
        # was queued rather than a share per idle worker.
        assert loop.time() - started >= 0.25
        assert [len(b) for b in gate.batches] == [1, 3]
        gate.open.set()
        assert await first == ["A"] and await asyncio.gather(*rest) == [[f"X{i}"] for i in range(3)]


async def test_without_overlap_after_queued_work_is_split_over_idle_workers() -> None:
    async with held_batcher(workers=3, max_batch=100) as (gate, batcher):
        jobs = [asyncio.create_task(batcher.submit([f"x{i}"], 1)) for i in range(6)]
        await poll(lambda: len(gate.batches) == 3)
        assert sorted(len(b) for b in gate.batches) == [2, 2, 2]
        gate.open.set()
        await asyncio.gather(*jobs)


async def test_close_while_a_batch_waits_to_overlap_fails_it_cleanly() -> None:
    async with held_batcher(workers=2, max_batch=8, overlap_after=30) as (gate, batcher):
        first = asyncio.create_task(batcher.submit(["a"], 1))
        await poll(gate.entered.is_set)
        waiting = asyncio.create_task(batcher.submit(["b"], 1))
        # submitted, then taken off the queue by the dispatcher and held by the stagger
        await poll(lambda: batcher.pending == 2 and batcher._queue.empty())
        await batcher.close()
        with pytest.raises(Unavailable) as info:
            await asyncio.wait_for(waiting, 5)
        assert info.value.reason == "SHUTTING_DOWN"
        first.cancel()


async def test_close_while_a_batch_encodes_before_its_post_stage_fails_it_cleanly() -> None:
    async with held_batcher(post=lambda jobs, staged: staged, workers=1, max_batch=8) as (gate, batcher):
        held = asyncio.create_task(batcher.submit(["a"], 1))
        await poll(gate.entered.is_set)
        await batcher.close()
        gate.open.set()       # the batch function returns after close: there is no post stage any more
        with pytest.raises(Unavailable) as info:
            await asyncio.wait_for(held, 5)
        assert info.value.reason == "SHUTTING_DOWN"


async def test_a_small_job_on_an_idle_batcher_runs_inline_and_one_behind_busy_work_is_queued() -> None:
    """`inline=True` (the encoder's small calls): on the event loop's thread when nothing is
    queued or running, skipping the thread hand-offs; behind running work it waits its turn."""
    threads: list[int] = []

    def work(jobs: list[list[str]]) -> list[list[str] | BaseException]:
        threads.append(threading.get_ident())
        return Gate()(jobs)

    batcher: Batcher[list[str], list[str]] = Batcher(work, workers=1, max_batch=10, max_pending=100)
    await batcher.start()
    try:
        assert await batcher.submit(["a"], 1, inline=True) == ["A"]
        assert threads == [threading.get_ident()] and batcher.batches_run == 1
        assert await batcher.submit(["b"], 1) == ["B"]          # not small: a worker thread
        assert threads[-1] != threading.get_ident()
        with pytest.raises(InvalidArgument):                  # a job's error, inline too
            await batcher.submit(["bad"], 1, inline=True)
        assert batcher.pending == 0
    finally:
        await batcher.close()
    async with held_batcher(workers=1, max_batch=10) as (gate, held):
        first = asyncio.create_task(held.submit(["a"], 1))
        await poll(gate.entered.is_set)
        second = asyncio.create_task(held.submit(["c"], 1, inline=True))
        await poll(lambda: held.pending == 2)                  # queued behind the running batch
        gate.open.set()
        assert (await first, await second) == (["A"], ["C"])
        assert [len(b) for b in gate.batches] == [1, 1]
