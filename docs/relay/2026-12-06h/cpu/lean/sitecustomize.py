"""Measurement only (docs/benchmarks.md, eighth session): how fast a router's first-token path can be when
a chat request goes straight through in one coroutine: the same ports (the local encoder, the Redis
admission's ENQUEUE, on an estimate before the encode as the request core does, or with TR_LEAN_EARLY=0
after it on the real count; the placement policy, the engine stream, the local detokenizer) but none of the
request core's structure or guarantees (no id claim, deadline, gate, span, metric, retry, session
stickiness, Accepted, cancellation handling; grants assumed). Never a way to run a router.

With TR_LEAN=<prefix> and this folder first on PYTHONPATH, a router process serves chat Generate calls
this way and writes one line per request to <prefix>.<pid>: ms after the handler's first line for
tok (tokenized), adm (granted), post (submit posted), first (first delta made)."""

import os
import sys

if os.environ.get("TR_LEAN") and any("router_svc" in a for a in sys.orig_argv):
    import asyncio
    import time
    import uuid

    import router_svc.servicer as sv
    from router_svc.cache_key import tokenize_cache_key
    from router_svc.ports import AdmitRequest, PlacementView
    from router_svc.tenants import tenant_limits
    from router_svc.types import DetokOut, Usage
    from services.proto.tokenrelay.v1 import common_pb2, inference_pb2

    _out = open(os.environ["TR_LEAN"] + f".{os.getpid()}", "w", buffering=1)
    _EARLY = os.environ.get("TR_LEAN_EARLY", "1") == "1"
    _full = sv.InferenceServicer.Generate

    async def lean(self, request, context):
        t0 = time.monotonic()
        if request.WhichOneof("input") != "messages":
            async for r in _full(self, request, context):
                yield r
            return
        ports, options = self.router.ports, self.router.options
        tenant = self._tenant(context)
        inp = sv.generate_input_from_pb(request)
        key = tokenize_cache_key(tenant.name, inp.session_id, inp.messages)
        kw = {"messages": inp.messages, "cache_key": key, "allow_special_tokens": tenant.allow_control_tokens}
        rid = uuid.uuid4().hex
        max_tokens = inp.sampling.max_tokens or 16
        limits = tenant_limits(tenant, options.default_max_queued)
        admit = None
        if _EARLY:   # the ENQUEUE on an estimate (characters / 3), started a loop turn before the encode
            estimate = sum(len(c) for _, c in inp.messages) // 3
            admit = asyncio.ensure_future(ports.admission.admit(AdmitRequest(
                tenant.name, rid, tenant.default_priority, estimate + max_tokens, 600.0, *limits)))
            await asyncio.sleep(0)
        ids = ports.tokenizer.tokenize_now(**kw)
        if ids is None:
            ids = await ports.tokenizer.tokenize(**kw)
        t_tok = time.monotonic()
        if admit is None:   # the ENQUEUE after the encode, on the real count
            admit = asyncio.ensure_future(ports.admission.admit(AdmitRequest(
                tenant.name, rid, tenant.default_priority, len(ids) + max_tokens, 600.0, *limits)))
        admitting = await admit
        while admitting.grant is None:
            await admitting.next()
        t_adm = time.monotonic()
        view = PlacementView(tenant.name, inp.session_id, len(ids), "", "", ids, tenant.name, max_tokens)
        address = ports.placement.choose(ports.engines.snapshots(), view, frozenset())
        upstream = uuid.uuid4().hex
        meta = ports.tokenizer.meta
        source = ports.engines.submit(address, upstream, ids, inp.sampling, list(meta.eos_token_ids), tenant.name,
                                      {}, priority=tenant.default_priority)
        t_post = time.monotonic()
        detok = ports.detokenize.detokenizer(upstream)
        detok.start(inp.sampling.stop, inp.sampling.include_stop_str, ids[-8:], {})
        usage, t_first, finish = Usage(prompt_tokens=len(ids)), 0.0, "length"
        try:
            done = False
            while not done:
                chunk = await source.get()
                usage.completion_tokens += len(chunk.token_ids)
                usage.cached_tokens = max(usage.cached_tokens, chunk.cached_tokens)
                detok.send(chunk.token_ids, chunk.finished)
                text = ""
                for out in await detok.next_ready():
                    if isinstance(out, DetokOut):
                        text += out.text
                        done = done or out.finished
                        finish = "stop" if out.matched_stop else finish
                    else:
                        raise out.error
                if text:
                    if not t_first:
                        t_first = time.monotonic()
                    yield inference_pb2.GenerateResponse(delta=inference_pb2.Delta(text=text))
        finally:
            ports.engines.release(address, upstream)
            detok.close(flushed=True)
            await admitting.grant.settle(usage)
        now = time.monotonic()
        _out.write(" ".join(f"{k}={(v - t0) * 1000:.3f}" for k, v in
                            (("tok", t_tok), ("adm", t_adm), ("post", t_post), ("first", t_first))) + "\n")
        yield inference_pb2.GenerateResponse(done=inference_pb2.Done(
            finish_reason=sv.FINISH_CODES[finish],
            usage=common_pb2.Usage(prompt_tokens=usage.prompt_tokens, cached_tokens=usage.cached_tokens,
                                   completion_tokens=usage.completion_tokens),
            timings=common_pb2.Timings(ttft_seconds=(t_first or now) - t0, total_seconds=now - t0)))

    sv.InferenceServicer.Generate = lean   # type: ignore[method-assign]
