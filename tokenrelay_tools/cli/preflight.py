"""What `tokenrelay up` checks before it starts anything: that no other mesh runs in its run
directory (one lock per directory, held for the launcher's life) and that the router's port is free.

A second `up` in the same run directory used to unlink the first mesh's Redis socket and port files,
and its Redis deleted the socket again on exit, so the first mesh answered every request with
REDIS_UNAVAILABLE; a port in use was a 40-line traceback after the engines had loaded (issue 14).
Both are now refused in one line, before a process is started, with exit status 2 (`Refused`).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pathlib
import re
import socket
from typing import IO

LOCK_NAME = "up.lock"
# What grpc core says when a bind fails (the router's log ends with it).
_BIND_FAILED = re.compile(r"(?:could not bind|Failed to bind to address) (\S+?)[:;]?(?:\s|$)", re.M)


class Refused(Exception):
    """`tokenrelay up` will not start: one line for the user, exit status 2."""


# Locks this process holds, by run directory: flock belongs to the open file, so a second open of
# the same lock file in this process would conflict with the first.
_HELD: dict[pathlib.Path, IO[str]] = {}


def claim_run_dir(run_dir: pathlib.Path) -> None:
    """Take the run directory for this process, or refuse: another live `up` holds it. The kernel
    drops the lock when its holder dies (even kill -9), so a crashed mesh never blocks the next."""
    key = run_dir.resolve()
    if key in _HELD:
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    handle = open(run_dir / LOCK_NAME, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "unknown"
        handle.close()
        raise Refused(f"tokenrelay up is already running in {run_dir} (pid {holder}): stop it, or pass "
                      "--run-dir (and --port 0 or another --port) to run a second mesh beside it") from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    _HELD[key] = handle


def release_run_dir(run_dir: pathlib.Path) -> None:
    """Give the run directory back (the lock file stays: removing it would race a waiting claimer)."""
    handle = _HELD.pop(run_dir.resolve(), None)
    if handle is not None:
        with contextlib.suppress(OSError):
            handle.truncate(0)
        handle.close()


def port_in_use(host: str, port: int, why: str = "") -> Refused:
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return Refused(f"port {where} is in use{f' ({why})' if why else ''}: pass --port 0 (any free "
                   "port; `generate` and `chat` find it in the state file) or another --port, or stop what "
                   "holds it")


def check_port_free(host: str, port: int) -> None:
    """Refuse a router port that something listens on. Probed without SO_REUSEPORT, so routers of
    another mesh bound with it (`--routers N`) count as holding it; SO_REUSEADDR lets past
    connections' TIME_WAIT pass. Port 0 is always free."""
    if not port:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise port_in_use(host, port, exc.strerror or "") from None


def bind_failure(log_tail: str) -> str | None:
    """The address a service's log says it failed to bind, if that is why it exited."""
    match = _BIND_FAILED.search(log_tail)
    return match.group(1) if match else None
