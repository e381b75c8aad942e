"""Waiting for a condition in tests: polled with a deadline, never a bare sleep as synchronisation."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any


async def poll(condition: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
    """Await until ``condition()`` (a plain or async callable) is truthy and return its value."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


def block_until(condition: Callable[[], Any], timeout: float, what: str) -> None:
    """Wait for ``condition()`` *without* letting the event loop turn (a blocking poll): for a test
    that shows something happened within the current loop step (e.g. a command written before the
    caller's coroutine yields), where awaiting would let the loop do it later."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(what)
        time.sleep(0.001)
