"""Measurement only (docs/benchmarks.md, eighth session): every Redis write of a router process timed
(router_svc/redis_scripts.py, `_Connection.write`, patched 6 s after it starts). TR_WRT=<file>, this folder
first on PYTHONPATH; `kill -USR1 <router pid>` writes one line per write: start, µs, the command's head."""

import os
import signal
import sys
import threading
import time

if os.environ.get("TR_WRT") and any("router_svc" in a for a in sys.orig_argv):
    rec: list[tuple[float, float, bytes]] = []

    def _patch() -> None:
        import router_svc.redis_scripts as rs

        write = rs._Connection.write
        clock = time.perf_counter

        def timed(self, entry, command):
            t0 = clock()
            write(self, entry, command)
            rec.append((t0, clock() - t0, bytes(command[:40])))

        rs._Connection.write = timed

    threading.Timer(6.0, _patch).start()

    def _dump(sig, frame) -> None:
        with open(os.environ["TR_WRT"], "w") as f:
            for t0, dt, head in rec:
                f.write(f"{t0:.6f} {dt * 1e6:.1f} {head!r}\n")

    signal.signal(signal.SIGUSR1, _dump)
