"""One owned background task: started by its owner, cancelled and awaited by its owner's close().

Every long-lived task in a service has an owner with start/close (house style); this is the one
implementation of that pair, so no owner hand-writes the cancel-and-await dance again. Also
`discard`, the same dance for a one-off task whose result is no longer wanted, and `retrieve`: the
done-callback of a future nobody may await; and `start_now`, a task whose first step runs at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
# Python 3.12's tasks may run their first step in the call that creates them (`eager_start`).
EAGER = sys.version_info >= (3, 12)


class OwnedTask:
    def __init__(self, name: str) -> None:
        self.name = name
        self._task: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def ensure(self, run: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Start ``run()`` unless it is already running (a task that ended may be started again)."""
        if not self.running:
            self._task = asyncio.get_running_loop().create_task(run(), name=self.name)

    async def close(self, timeout: float = 10.0) -> None:
        """Cancel and await it. A cancel that the task's code swallowed (Python 3.11's `asyncio.timeout`
        can lose an outer cancel that lands as its own deadline passes; some libraries' waits catch it)
        is sent again every 50 ms, for at most `timeout` s: a close never hangs on it. The task's own
        error, if it failed, is raised."""
        task, self._task = self._task, None
        if task is None:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not task.done() and loop.time() < deadline:
            task.cancel()
            await asyncio.wait({task}, timeout=0.05)
        if task.done():
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def discard(task: asyncio.Future[Any]) -> None:
    """Cancel work whose result is no longer wanted and wait for it (its error is moot)."""
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task


def retrieve(fut: asyncio.Future[Any]) -> None:
    """A done-callback for a future whose outcome nobody may read (an abandoned operation, a prefetch
    its request did not live to use): its exception counts as seen, so asyncio never logs it."""
    if not fut.cancelled():
        fut.exception()


def start_now(coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
    """A task for `coro` whose first step runs now, in this call, up to its first real suspension
    (Python 3.12+: `eager_start`; on older Pythons an ordinary task, whose first step runs in the
    next loop turn). For work on a request's path whose first step writes something (a Redis call,
    a submit to an engine): it is on its way without waiting for a loop turn. The caller's code
    after this call then runs after that first step, not before it; a coroutine that finishes
    without suspending gives a task that is already done."""
    loop = asyncio.get_running_loop()
    if EAGER:
        return asyncio.Task(coro, loop=loop, eager_start=True)  # type: ignore[call-arg]
    return loop.create_task(coro)
