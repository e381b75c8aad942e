"""Marks on a router request's first-token path, for measurement only (docs/benchmarks.md, "The first
token's path under chat-multiturn, 2026-12-06, sixth session"). Not part of tokenrelay.

With this folder first on PYTHONPATH and TR_TL=<prefix> in the environment, a router process (and no
other) wraps a few functions 6 s after it starts (its modules are loaded by then) and writes one line
per finished request to <prefix>.<pid>: monotonic marks in ms after the call arrived (the servicer's
`t_arrival`):

  gen0   the pipeline's validation starts (`validate_input`)
  lt0    the local tokenizer port is entered (LocalTokenize.tokenize; after the early ENQUEUE's and the
         id claim's first steps)          enc0 / enc1  the encoder starts / returns
  tok    tokenized (RequestState.t_tokenized)   claim  the id claim answered   adm  admitted
  p0/p1  placement starts / ends (EngineStage._place)   post  the submit posted to the engine stream
  first  the first client delta made (RequestState.t_first)

    TR_TL=/tmp/tl PYTHONPATH=docs/relay/2026-12-06f/cpu/timeline:$PWD tokenrelay up --engine sim ...
    tokenrelay bench --workload chat-multiturn ...; python docs/relay/2026-12-06f/cpu/timeline/summ.py /tmp/tl.*
"""

import os
import sys
import threading
import time

if os.environ.get("TR_TL") and any("router_svc" in a for a in sys.orig_argv):

    def _patch() -> None:
        import structlog

        import router_svc.engine_stage as es
        import router_svc.local_tokenize as lt
        import router_svc.pipeline as pl
        import router_svc.replies as rp
        import router_svc.upstreams as up
        import services.tokenization.encoder as enc

        out = open(os.environ["TR_TL"] + f".{os.getpid()}", "w", buffering=1)
        marks: dict[str, dict[str, float]] = {}
        mono = time.monotonic

        def by_request(name: str) -> None:
            rid = structlog.contextvars.get_contextvars().get("request_id")
            if rid:
                marks.setdefault("r:" + rid, {}).setdefault(name, mono())

        place = es.EngineStage._place

        def placed(self, state, view, ctx):
            m = marks.setdefault(state.upstream_id, {})
            m["p0"] = mono()
            address = place(self, state, view, ctx)
            m["p1"] = mono()
            return address

        es.EngineStage._place = placed
        submit = up.EngineReplica.submit

        def submitted(self, request_id, *a, **k):
            inbox = submit(self, request_id, *a, **k)
            marks.setdefault(request_id, {})["post"] = mono()
            return inbox

        up.EngineReplica.submit = submitted
        validate = pl.validate_input

        def validated(*a, **k):
            by_request("gen0")
            return validate(*a, **k)

        pl.validate_input = validated
        tokenize = lt.LocalTokenize.tokenize

        async def tokenized(self, **k):
            by_request("lt0")
            return await tokenize(self, **k)

        lt.LocalTokenize.tokenize = tokenized
        encode = enc.Encoder.tokenize

        async def encoded(self, items):
            by_request("enc0")
            ids = await encode(self, items)
            by_request("enc1")
            return ids

        enc.Encoder.tokenize = encoded
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
