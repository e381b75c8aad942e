"""One owned background task: started by its owner, cancelled and awaited by its owner's close().

Every long-lived task in a service has an owner with start/close (house style); this is the one
implementation of that pair, so no owner hand-writes the cancel-and-await dance again. Also
`discard`, the same dance for a one-off task whose result is no longer wanted, and `retrieve`: the
done-callback of a future nobody may await.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from typing import Any


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
