"""A progress bar on plain stderr while a bench runs (no dependency; one line, redrawn in place).

On a terminal the line is redrawn a few times a second; when stderr is a file or a pipe (CI
logs) a full line is printed every few seconds instead, so logs stay readable.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from typing import TextIO

from .runner import Runner


class Progress:
    def __init__(self, runner: Runner, *, label: str, total: int | None, duration: float | None,
                 stream: TextIO | None = None, width: int = 24) -> None:
        self.runner = runner
        self.label = label
        self.total = total
        self.duration = duration
        self.stream = stream or sys.stderr
        self.width = width
        self.tty = self.stream.isatty()
        self._task: asyncio.Task[None] | None = None

    def line(self) -> str:
        r = self.runner
        fractions = [r.issued / self.total if self.total else 0.0,
                     r.elapsed / self.duration if self.duration else 0.0]
        frac = min(1.0, max(fractions))
        filled = round(frac * self.width)
        bar = "#" * filled + "-" * (self.width - filled)
        limit = f"/{self.total}" if self.total else ""
        return (f"[{self.label}] [{bar}] {frac * 100:3.0f}%  {r.elapsed:6.1f}s  sent {r.issued}{limit}  "
                f"ok {r.ok}  err {r.errors}  in-flight {r.in_flight}")

    def _draw(self) -> None:
        if self.tty:
            self.stream.write("\r" + self.line() + "\x1b[K")
        else:
            self.stream.write(self.line() + "\n")
        self.stream.flush()

    async def _loop(self) -> None:
        interval = 0.25 if self.tty else 5.0
        while True:
            await asyncio.sleep(interval)
            self._draw()

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="bench-progress")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._draw()
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
