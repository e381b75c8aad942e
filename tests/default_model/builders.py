"""Stand-in builders that `default_model.build_in_child` runs in its child process (by name)."""

from __future__ import annotations

import os
import pathlib
import time
from typing import Any

from tokenrelay_tools import default_model as dm

BALLAST_MB = 300


def chatty(out_dir: pathlib.Path, log: Any) -> dict[str, Any]:
    """Holds BALLAST_MB of memory, as a real build does, through a step that logs nothing itself."""
    ballast = bytearray(BALLAST_MB << 20)
    ballast[::4096] = b"\x01" * len(ballast[::4096])  # touch every page: resident, not just reserved
    with dm.step("a silent step", log):
        # The work being simulated (not a synchronisation), chattering as libraries do: lines
        # that are not the builder's own must not count as progress.
        for _ in range(30):
            print("Loading weights: 42%|####      |", flush=True)
            time.sleep(0.015)
    for name in dm.REQUIRED_FILES:
        (out_dir / name).write_text("{}")
    return {"builder_pid": os.getpid(), "ballast": len(ballast)}


def failing(out_dir: pathlib.Path, log: Any) -> dict[str, Any]:
    log("about to fail")
    raise OSError("disk full")
