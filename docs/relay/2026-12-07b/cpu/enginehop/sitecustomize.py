"""Marks on both ends of the engine hop, for measurement only (docs/benchmarks.md, eleventh session); not
part of tokenrelay. With this folder first on PYTHONPATH and TR_EH=<prefix>, each router and engine process
wraps a few functions 6 s after it starts and writes `<mark> <request id> <monotonic s>` lines to
<prefix>.<role>.<pid> (CLOCK_MONOTONIC is one clock for every process of the host):

  router: post   the submit posted to the engine's stream      (EngineReplica.submit returned)
          out    the stream's next message built with it       (upstreams._engine_build)
          in     the first message with a chunk of it read     (upstreams._engine_split)
          dsend  its first tokens handed to its detokenizer      (LocalDetokSession.send returned)
          first  its first delta handed to the client's stream (RequestState.t_first, at the request's end)
  engine: ein    the submit decoded                            (servicer.request_from_proto)
          etok   its first token pushed to the stream's outbox (Outbox.push)
          esend  the message with that chunk built             (servicer.chunk_to_proto)

    python docs/relay/2026-12-07b/cpu/enginehop/summ.py <prefix>.*
"""

import os
import sys
import threading
import time

_ROLE = next((r for r in ("router_svc", "engine_svc") if any(r in a for a in sys.orig_argv)), None)

if os.environ.get("TR_EH") and _ROLE:

    def _patch() -> None:
        import importlib

        out = open(os.environ["TR_EH"] + f".{_ROLE}.{os.getpid()}", "w", buffering=1)
        mono = time.monotonic
        seen: set[tuple[str, str]] = set()

        def mark(name: str, rid: str) -> None:
            if (name, rid) not in seen:
                seen.add((name, rid))
                out.write(f"{name} {rid} {mono():.6f}\n")

        def wrap(module: str, attr: str, after) -> None:
            mod, _, cls = module.partition(":")
            owner = importlib.import_module(mod)
            if cls:
                owner = getattr(owner, cls)
            fn = getattr(owner, attr)

            def wrapped(*a, **k):
                r = fn(*a, **k)
                after(a, r)
                return r
            setattr(owner, attr, wrapped)

        if _ROLE == "router_svc":
            import router_svc.replies as rp
            import router_svc.upstreams as up

            def built(a, r):
                for s in r.submit:
                    mark("out", s.request_id)
            wrap("router_svc.upstreams", "_engine_build", built)

            def split(a, r):
                for rid, c in r:
                    if c.token_ids:
                        mark("in", rid)
            wrap("router_svc.upstreams", "_engine_split", split)

            def posted(a, r):
                mark("post", a[1])
                # A replica's stream holds the functions it was given (the router's objects are
                # gc-frozen at its start, out of gc.get_objects()'s sight): give it the wrapped ones.
                mux = a[0].mux
                if mux._build is not up._engine_build:
                    mux._build, mux._split = up._engine_build, up._engine_split
            wrap("router_svc.upstreams:EngineReplica", "submit", posted)

            def detok_sent(a, r):
                if a[1]:
                    mark("dsend", a[0].request_id)
            wrap("router_svc.local_detok:LocalDetokSession", "send", detok_sent)
            done_event = rp.done_event

            def done(state, metrics, merged):
                if state.t_first:
                    out.write(f"first {state.upstream_id} {state.t_first:.6f}\n")
                    out.write(f"arrival {state.upstream_id} {state.t_arrival:.6f}\n")
                return done_event(state, metrics, merged)
            rp.done_event = done
            import router_svc.pipeline as pl
            pl.done_event = done
        else:
            import engine_svc.servicer as sv
            wrap("engine_svc.servicer", "request_from_proto", lambda a, r: mark("ein", a[0].request_id))

            def pushed(a, r):
                if a[1].token_ids:
                    mark("etok", a[1].request_id)
            wrap("engine_svc.outbox:Outbox", "push", pushed)

            def sent(a, r):
                if a[0].token_ids:
                    mark("esend", a[0].request_id)
            wrap("engine_svc.servicer", "chunk_to_proto", sent)
            del sv

    threading.Timer(6.0, _patch).start()
