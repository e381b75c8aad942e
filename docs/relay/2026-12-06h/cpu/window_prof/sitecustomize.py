"""Measurement only (docs/benchmarks.md, eighth session): cProfile on from a Generate call's first line to its
engine submit, in a router process (patched 6 s after it starts). TR_PROF=<prefix>, this folder first on
PYTHONPATH; `kill -USR1 <router pid>` writes <prefix>.<pid> and the request count to <prefix>.n.
Report: python report.py <prefix>.<pid> $(cat <prefix>.n)"""

import os
import signal
import sys
import threading

if os.environ.get("TR_PROF") and any("router_svc" in a for a in sys.orig_argv):
    import cProfile

    prof = cProfile.Profile()
    state = {"n": 0, "on": False}

    def _patch() -> None:
        import router_svc.servicer as sv
        import router_svc.upstreams as up

        from_pb = sv.generate_input_from_pb

        def started(request):
            if not state["on"]:
                state["on"] = True
                state["n"] += 1
                prof.enable()
            return from_pb(request)

        sv.generate_input_from_pb = started
        submit = up.EngineReplica.submit

        def submitted(self, *a, **k):
            inbox = submit(self, *a, **k)
            if state["on"]:
                prof.disable()
                state["on"] = False
            return inbox

        up.EngineReplica.submit = submitted

    threading.Timer(6.0, _patch).start()

    def _dump(sig, frame) -> None:
        prof.disable()
        prof.dump_stats(os.environ["TR_PROF"] + f".{os.getpid()}")
        with open(os.environ["TR_PROF"] + ".n", "w") as f:
            f.write(str(state["n"]))

    signal.signal(signal.SIGUSR1, _dump)
