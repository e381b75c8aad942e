"""services/tasks.OwnedTask: close() cancels and awaits; a task that swallows the cancel (as Python 3.11's
`asyncio.timeout` can when an outer cancel lands as its own deadline passes, seen as a hung admission
close in tests/router/test_budget_memo.py) is cancelled again until it ends, never waited on forever."""

from __future__ import annotations

import asyncio

import pytest

from services.tasks import OwnedTask


async def test_a_task_that_swallows_one_cancel_is_closed_anyway() -> None:
    swallowed: list[bool] = []

    async def stubborn() -> None:
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if swallowed:
                    raise
                swallowed.append(True)       # the first cancel is lost; it waits again

    owned = OwnedTask("stubborn")
    owned.ensure(stubborn)
    await asyncio.sleep(0)
    async with asyncio.timeout(2):
        await owned.close()
    assert swallowed == [True] and not owned.running


async def test_a_task_that_never_ends_is_given_up_after_the_timeout() -> None:
    stop = asyncio.Event()

    async def deaf() -> None:
        while not stop.is_set():
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                pass

    owned = OwnedTask("deaf")
    owned.ensure(deaf)
    task = owned._task
    assert task is not None
    await asyncio.sleep(0)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    await owned.close(timeout=0.3)
    assert 0.25 <= loop.time() - t0 < 1.0 and not owned.running and not task.done()
    stop.set()          # the test's own cleanup: let it end
    await task


async def test_its_own_error_is_raised() -> None:
    async def fails() -> None:
        raise ValueError("boom")

    owned = OwnedTask("fails")
    owned.ensure(fails)
    await asyncio.sleep(0)
    with pytest.raises(ValueError, match="boom"):
        await owned.close()
