"""Finer marks on a router request's first-token path, for measurement only (docs/benchmarks.md, tenth
session). Not part of tokenrelay. The sixth session's marks (docs/relay/2026-12-06f/cpu/timeline/) plus the
steps between the grant and the placement:

  run0   the detokenizer session is made (`Router._run`'s first port call)   d1  its `start` returned
  s0     the engine stage's task starts (`EngineStage.run`)                  v1  its placement view is ready

With this folder first on PYTHONPATH and TR_TL=<prefix>, a router process wraps the functions 6 s after it
starts and writes one line per finished request to <prefix>.<pid>, marks in ms after the call arrived.
    python docs/relay/2026-12-07/cpu/timeline/summ.py <prefix>.*
"""

import os
import sys
import threading
import time

if os.environ.get("TR_TL") and any("router_svc" in a for a in sys.orig_argv):

    def _patch() -> None:
        import importlib

        import structlog

        out = open(os.environ["TR_TL"] + f".{os.getpid()}", "w", buffering=1)
        marks: dict[str, dict[str, float]] = {}
        mono = time.monotonic

        def by_request(name: str) -> None:
            rid = structlog.contextvars.get_contextvars().get("request_id")
            if rid:
                marks.setdefault("r:" + rid, {}).setdefault(name, mono())

        def by_key(key: str, name: str) -> None:
            marks.setdefault(key, {})[name] = mono()

        def wrap(module: str, attr: str, before=None, after=None, key=None, coroutine=False) -> None:
            mod, _, cls = module.partition(":")
            owner = importlib.import_module(mod)
            if cls:
                owner = getattr(owner, cls)
            fn = getattr(owner, attr)

            def mark(name, a, k):
                if name:
                    by_key(key(a, k), name) if key else by_request(name)
            if coroutine:
                async def wrapped(*a, **k):
                    mark(before, a, k)
                    r = await fn(*a, **k)
                    mark(after, a, k)
                    return r
            else:
                def wrapped(*a, **k):
                    mark(before, a, k)
                    r = fn(*a, **k)
                    mark(after, a, k)
                    return r
            setattr(owner, attr, wrapped)

        up_id = lambda a, k: a[1].upstream_id           # noqa: E731  (self, state, ...)
        wrap("router_svc.engine_stage:EngineStage", "_place", "p0", "p1", up_id)
        wrap("router_svc.engine_stage:EngineStage", "run", "s0", None, up_id, coroutine=True)
        wrap("router_svc.engine_stage:EngineStage", "_view", None, "v1", up_id, coroutine=True)
        wrap("router_svc.upstreams:EngineReplica", "submit", None, "post", lambda a, k: a[1])
        wrap("router_svc.local_detok:LocalDetokenize", "detokenizer", "run0", None, lambda a, k: a[1])
        wrap("router_svc.local_detok:LocalDetokSession", "start", None, "d1", lambda a, k: a[0].request_id)
        wrap("router_svc.pipeline", "validate_input", "gen0")
        wrap("router_svc.local_tokenize:LocalTokenize", "tokenize", "lt0", coroutine=True)
        wrap("services.tokenization.encoder:Encoder", "tokenize", "enc0", "enc1", coroutine=True)

        import router_svc.pipeline as pl
        import router_svc.replies as rp
        done_event = rp.done_event

        def done(state, metrics, merged):
            event = done_event(state, metrics, merged)
            m = {**marks.pop(state.upstream_id, {}), **marks.pop("r:" + state.request_id, {})}
            m.update(tok=state.t_tokenized, claim=state.t_claimed, adm=state.t_admitted, first=state.t_first or 0.0)
            out.write(f"{len(state.prompt_ids)} " + " ".join(
                f"{k}={(v - state.t_arrival) * 1000:.3f}" for k, v in m.items() if v) + "\n")
            return event

        rp.done_event = done
        pl.done_event = done

    threading.Timer(6.0, _patch).start()
