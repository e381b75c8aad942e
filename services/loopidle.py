"""How long an asyncio loop waits in its selector: the share of time it is idle.

A loop that never waits is saturated whatever it is given: a process on a shared or CPU-limited host
may get well under a core (so its CPU share says little), while every turn still finds work ready.
`idle_seconds(loop)` meters the loop's selector (installed on first use: the selector is wrapped so
that a `select()` that may wait is timed, two clock reads per such loop turn; a poll with a
zero timeout, made while callbacks are ready, is not a wait) and returns the seconds spent waiting in
it since then. Loops without a selector to meter (e.g. uvloop) return None, and callers fall back
to the process's CPU time.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any


class _MeteredSelector:
    """The loop's selector, `select()` timed; everything else passes through."""

    __slots__ = ("_inner", "idle")

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.idle = 0.0

    def select(self, timeout: float | None = None) -> Any:
        if timeout is not None and timeout <= 0:     # a poll between ready callbacks: no wait
            return self._inner.select(timeout)
        started = time.perf_counter()
        try:
            return self._inner.select(timeout)
        finally:
            self.idle += time.perf_counter() - started

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def idle_seconds(loop: asyncio.AbstractEventLoop) -> float | None:
    """Seconds `loop` has waited in its selector since metering began (None: cannot be metered)."""
    selector = getattr(loop, "_selector", None)
    if selector is None or not callable(getattr(selector, "select", None)):
        return None
    if not isinstance(selector, _MeteredSelector):
        selector = _MeteredSelector(selector)
        loop._selector = selector   # type: ignore[attr-defined]
    return selector.idle
