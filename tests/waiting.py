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
