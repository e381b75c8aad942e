"""The client hop of a Generate call, for measurement only (not part of tokenrelay): with this folder first on
PYTHONPATH and TR_HOP=<prefix>, a router process writes per call (to <prefix>.<pid>) the client's send time
from the `x-sent-ns` metadata and, in wall-clock ns, when the servicer's Generate started, when it yielded its
first delta to gRPC and when gRPC asked for the next message (the first delta written). Client:
docs/relay/2026-12-07/cpu/hop/client.py."""

import os
import sys
import time

if os.environ.get("TR_HOP") and any("router_svc" in a for a in sys.orig_argv):
    import router_svc.servicer as sv

    _out = open(os.environ["TR_HOP"] + f".{os.getpid()}", "w", buffering=1)
    _generate = sv.InferenceServicer.Generate

    async def _timed(self, request, context):
        w0 = time.time_ns()
        sent = next((v for k, v in context.invocation_metadata() if k == "x-sent-ns"), "0")
        first = True
        async for item in _generate(self, request, context):
            if first and item.HasField("delta"):
                first = False
                w1 = time.time_ns()
                yield item
                _out.write(f"{request.request_id} {sent} {w0} {w1} {time.time_ns()}\n")
            else:
                yield item

    sv.InferenceServicer.Generate = _timed
