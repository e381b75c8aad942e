"""How long an asyncio loop waits in its selector: the share of time it is idle.

A loop that never waits is saturated whatever it is given: a process on a shared or CPU-limited host
may get well under a core (so its CPU share says little), while every turn still finds work ready.
`idle_seconds(loop)` meters the loop's selector (installed on first use: the selector is wrapped so
that a `select()` that may wait is timed, two clock reads per such loop turn; a poll with a
zero timeout, made while callbacks are ready, is not a wait) and returns the seconds spent waiting in
it since then. Loops without a selector to meter (e.g. uvloop) return None, and callers fall back
to CPU time (`cpu_allowance`, and `services/mux.py`'s `_Waker`). A loop kept polling on purpose
(`--idle-spin-ms`) reports its idle turns through `add_spun_idle`, which both meters leave out.
"""

from __future__ import annotations

import asyncio
import os
import pathlib
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


# Seconds this process's loop spent polling with nothing else to do (`router_svc/overload.py`'s
# IdleSpin: turns that ran only its own callback). Busy-share meters subtract them: a spinning loop
# never waits in its selector and its thread never stops using CPU, yet it is idle.
_spun_idle = 0.0


def add_spun_idle(seconds: float) -> None:
    global _spun_idle
    _spun_idle += seconds


def spun_idle_seconds() -> float:
    """Seconds of idle spinning so far (module note above `add_spun_idle`)."""
    return _spun_idle


def idle_seconds(loop: asyncio.AbstractEventLoop) -> float | None:
    """Seconds `loop` has waited in its selector since metering began (None: cannot be metered)."""
    selector = getattr(loop, "_selector", None)
    if selector is None or not callable(getattr(selector, "select", None)):
        return None
    if not isinstance(selector, _MeteredSelector):
        selector = _MeteredSelector(selector)
        loop._selector = selector   # type: ignore[attr-defined]
    return selector.idle


def cpu_allowance(cgroup_root: pathlib.Path = pathlib.Path("/sys/fs/cgroup"),
                  own_cgroups: str | None = None) -> float:
    """How many CPUs this process may use: the CPUs it may run on (its affinity), capped by the CPU
    quota of its cgroup (v2 `cpu.max`, v1 `cpu.cfs_quota_us`: e.g. a Kubernetes CPU limit) where one
    is set. `own_cgroups`: the text of /proc/self/cgroup (read when None)."""
    try:
        cpus = float(len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        cpus = float(os.cpu_count() or 1)
    quota = _quota(cgroup_root, own_cgroups)
    return max(min(cpus, quota), 0.01) if quota else cpus


def _quota(root: pathlib.Path, own: str | None) -> float:
    """The CPU quota in CPUs (0.0: none, or none found)."""
    try:
        lines = (own if own is not None else pathlib.Path("/proc/self/cgroup").read_text()).splitlines()
    except OSError:
        return 0.0
    for line in lines:
        try:
            _, controllers, path = line.split(":", 2)
            where = path.lstrip("/")
            if controllers == "":                                       # v2
                limit, period = (root / where / "cpu.max").read_text().split()[:2]
                return 0.0 if limit == "max" else int(limit) / int(period)
            if "cpu" in controllers.split(","):                          # v1
                base = root / controllers / where
                if not base.exists():
                    base = root / "cpu" / where
                limit_us = int((base / "cpu.cfs_quota_us").read_text())
                return 0.0 if limit_us < 0 else limit_us / int((base / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError, ZeroDivisionError):
            continue     # not this hierarchy (a hybrid host mounts both): try the next line
    return 0.0
