"""Which asyncio event loop a process runs on: the one place a service's `main` starts its loop.

`run(main, choice)` runs the coroutine on uvloop (libuv) or on the standard library's loop:
- ``"uvloop"``: uvloop, and a clear error when it is not installed;
- ``"asyncio"``: the standard loop;
- ``"auto"``: uvloop when it is importable, else the standard loop.

Why a choice at all: the router's relay is bound by per-message work in gRPC's Cython path and in the
loop's own plumbing (`call_soon`, futures, the selector); uvloop does the second part in C. grpc.aio
runs on it (its completion-queue poller hands completions to whichever loop runs the call). What
was measured, and which loop is the default, is in `docs/architecture.md` ("Event loop").
`services.loopidle` cannot meter uvloop's selector; the mux then reads the loop thread's CPU time.
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Coroutine
from typing import Any, Literal, TypeVar, get_args

T = TypeVar("T")
LoopChoice = Literal["auto", "uvloop", "asyncio"]
LOOP_CHOICES: tuple[LoopChoice, ...] = get_args(LoopChoice)


class LoopUnavailable(RuntimeError):
    """``uvloop`` was asked for and is not installed."""


def uvloop_available() -> bool:
    return importlib.util.find_spec("uvloop") is not None


def resolve(choice: LoopChoice) -> Literal["uvloop", "asyncio"]:
    """The loop `run` will use for `choice` (raises `LoopUnavailable` for a missing uvloop)."""
    if choice == "asyncio":
        return "asyncio"
    if uvloop_available():
        return "uvloop"
    if choice == "uvloop":
        raise LoopUnavailable("--event-loop uvloop: uvloop is not installed (pip install uvloop, "
                              "or pass --event-loop asyncio)")
    return "asyncio"


def run(main: Coroutine[Any, Any, T], choice: LoopChoice) -> T:
    """Run `main` to completion on the loop `choice` resolves to (module doc)."""
    try:
        kind = resolve(choice)
    except LoopUnavailable:
        main.close()       # never awaited: close it so Python does not warn about it
        raise
    if kind == "uvloop":
        import uvloop

        return uvloop.run(main)
    return asyncio.run(main)
