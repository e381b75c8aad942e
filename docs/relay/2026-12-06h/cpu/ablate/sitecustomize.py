"""Measurement only (docs/benchmarks.md, eighth session): a router process with parts of its request path
taken out, to see what each costs in place at chat-multiturn's load; never a configuration to run.
TR_ABL is a comma list of:
  trace   no tracer provider installed (OpenTelemetry's no-op tracer: no sampler, no span objects)
  claim   the request id's claim answered at once, no Redis call (ids are then not unique across routers)
  sticky  the session's replica not asked of Redis (placement sees none)
  metrics Prometheus values not updated (their calls still made)
The first token's marks of docs/relay/2026-12-06f/cpu/timeline/ are written as well (TR_TL)."""

import os
import pathlib
import sys

_ABL = set(filter(None, os.environ.get("TR_ABL", "").split(",")))
if _ABL and any("router_svc" in a for a in sys.orig_argv):
    if "trace" in _ABL:
        import services.tracing

        services.tracing.configure_tracing = lambda *a, **k: None   # type: ignore[assignment]
    if "claim" in _ABL:
        import router_svc.cluster as cluster

        async def _claim(self, tenant: str, request_id: str) -> bool:
            return True

        cluster.RedisRequestRegistry.claim = _claim   # type: ignore[method-assign]
        cluster.RedisRequestRegistry.remote = False   # type: ignore[misc]
    if "sticky" in _ABL:
        import router_svc.cluster as cluster

        async def _get(self, tenant: str, session_id: str) -> str:
            return ""

        cluster.RedisSessionAffinity.get = _get   # type: ignore[method-assign]
    if "metrics" in _ABL:
        import prometheus_client.values as values

        values.MutexValue.inc = lambda self, amount: None          # type: ignore[method-assign]
        values.MutexValue.set = lambda self, value, timestamp=None: None   # type: ignore[method-assign]

_TL = pathlib.Path(os.environ.get("TR_TL_SITE") or pathlib.Path(__file__).resolve().parents[3] / "2026-12-06f"
                   / "cpu" / "timeline" / "sitecustomize.py")   # TR_TL_SITE: where that file is when this one is copied
exec(compile(_TL.read_text(), str(_TL), "exec"))
