"""Engine metrics (Prometheus): load gauges read at scrape time, per-request counters and latency
histograms, and engine step histograms. Every name is listed in docs/metrics-engine.md.

Three sources, each chosen for its cost on the hot path:

- Load gauges (active / queued requests, KV blocks used / free / cached, the backend's own prefix
  hit ratio) are not updated at all while serving: a collector calls ``backend.load()`` and
  ``backend.prefix_cache_stats()`` when /metrics is scraped. That runs on the HTTP server's
  thread, which is why `Backend.load()` may only read sizes and counters. With several engines
  in one process (tests) the values are summed.
- Per-request metrics are recorded by `engine_svc.telemetry.RequestTelemetry` from each
  request's events: one unlabelled counter increment per event and a few observations per
  request. Label children are built once here, never looked up per token.
- Step histograms come from backends that step in Python and call `Backend.step_observer`
  (`sim`: the prefill and decode seconds its cost model charged for the step, i.e. the time the
  modelled GPU would take). The `hf` backend steps in transformers' own thread; its prefill and
  decode cost show in the per-request histograms instead — time to first token and time per
  output token, as seen by the backend's result callbacks on the event loop.

Prefix-cache hit rate is ``rate(tokenrelay_engine_cached_tokens_total[5m]) /
rate(tokenrelay_engine_prompt_tokens_total[5m])``; both count requests once they produce their
first token (i.e. were prefilled), so cancelled-while-queued requests skew neither side.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator

from prometheus_client import REGISTRY, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from services.metrics import FAST_BUCKETS, ITL_BUCKETS, LATENCY_BUCKETS

from .backends.base import Backend, FinishReason, StepStats
from .backends.events import HealthState

_P = "tokenrelay_engine_"
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)

REQUESTS = Counter(_P + "requests_total", "Accepted requests that finished, by finish reason "
                   "(length, stop, cancelled, error)", ["finish_reason"])
REJECTIONS = Counter(_P + "rejections_total", "Requests refused at submit, by reason "
                     "(OVERLOADED, SHUTTING_DOWN, EMPTY_PROMPT, DUPLICATE_REQUEST_ID, ...)", ["reason"])
PROMPT_TOKENS = Counter(_P + "prompt_tokens_total", "Prompt tokens of requests that were prefilled "
                        "(counted at their first token)")
CACHED_TOKENS = Counter(_P + "cached_tokens_total", "Prompt tokens served from the prefix cache "
                        "(of prompt_tokens_total)")
GENERATED_TOKENS = Counter(_P + "generated_tokens_total", "Tokens generated and sent")
TTFT = Histogram(_P + "ttft_seconds", "Submit to first token, per request", buckets=LATENCY_BUCKETS)
TPOT = Histogram(_P + "time_per_output_token_seconds", "Mean time per token after the first, per "
                 "request with more than one token event", buckets=ITL_BUCKETS)
E2E = Histogram(_P + "e2e_seconds", "Submit to finish, per accepted request", buckets=LATENCY_BUCKETS)
PREFILL_STEP = Histogram(_P + "prefill_step_seconds", "Prefill time of an engine step that admitted "
                         "prompts (backends that report steps)", buckets=FAST_BUCKETS)
DECODE_STEP = Histogram(_P + "decode_step_seconds", "Decode time of an engine step (backends that "
                        "report steps)", buckets=FAST_BUCKETS)
DECODE_BATCH = Histogram(_P + "decode_batch_size", "Requests decoded per engine step (backends that "
                         "report steps)", buckets=BATCH_BUCKETS)

FINISHED = {reason: REQUESTS.labels(reason.value) for reason in FinishReason}
_rejections: dict[str, Counter] = {}


def count_rejection(reason: str) -> None:
    child = _rejections.get(reason)
    if child is None:
        child = _rejections[reason] = REJECTIONS.labels(reason)
    child.inc()


def observe_step(step: StepStats) -> None:
    """`Backend.step_observer`: one call per engine step."""
    if step.prefill_tokens:
        PREFILL_STEP.observe(step.prefill_seconds)
    DECODE_STEP.observe(step.decode_seconds)
    DECODE_BATCH.observe(step.batch_size)


class LoadCollector(Collector):
    """Load gauges computed from the attached backends at scrape time."""

    def __init__(self) -> None:
        # Weak, so an engine a test forgot to close does not haunt later scrapes; the lock
        # because attach/detach run on the event loop while collect runs on the HTTP thread.
        self._backends: weakref.WeakSet[Backend] = weakref.WeakSet()
        self._lock = threading.Lock()

    def attach(self, backend: Backend) -> None:
        with self._lock:
            self._backends.add(backend)

    def detach(self, backend: Backend) -> None:
        with self._lock:
            self._backends.discard(backend)

    def describe(self) -> Iterator[Metric]:
        return self._families([])

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            backends = list(self._backends)
        return self._families(backends)

    def _families(self, backends: list[Backend]) -> Iterator[Metric]:
        loads = [b.load() for b in backends]
        caches = [c for c in (b.prefix_cache_stats() for b in backends) if c is not None]
        info = GaugeMetricFamily(_P + "info", "Backend and model served (value 1)", labels=["backend", "model"])
        for backend, model in sorted({(s.backend, s.model) for s in loads}):
            info.add_metric([backend, model], 1)
        yield info
        used = sum(s.kv_blocks_used for s in loads)
        gauges = (
            ("active_requests", "Requests in the running batch", sum(s.active for s in loads)),
            ("queued_requests", "Accepted requests waiting for the batch", sum(s.queued for s in loads)),
            ("max_active_requests", "Running batch capacity", sum(s.max_active for s in loads)),
            ("kv_blocks_used", "KV cache blocks referenced by live requests", used),
            ("kv_blocks_free", "KV cache blocks not referenced by live requests (includes cached "
                               "reclaimable blocks)", sum(s.kv_blocks_total for s in loads) - used),
            ("kv_blocks_cached", "Unreferenced KV blocks kept for prefix reuse (backends with a "
                                 "prefix cache; part of kv_blocks_free)", sum(c.cached_blocks for c in caches)),
        )
        for name, doc, value in gauges:
            yield GaugeMetricFamily(_P + name, doc, value=value)
        hits = sum(c.hit_blocks for c in caches)
        lookups = hits + sum(c.miss_blocks for c in caches)
        yield GaugeMetricFamily(_P + "prefix_cache_hit_ratio", "The backend's own prefix-cache hit ratio "
                                "since start, in full prompt blocks (0 without lookups or prefix cache)",
                                value=hits / lookups if lookups else 0.0)
        yield CounterMetricFamily(_P + "kv_evicted_blocks", "Cached KV blocks evicted for new allocations",
                                  value=sum(c.evicted_blocks for c in caches))
        yield GaugeMetricFamily(_P + "dead", "1 when the backend reported its engine dead (the service then "
                                "answers NOT_SERVING and fails every request)",
                                value=sum(1 for b in backends if b.health() is HealthState.DEAD))
        yield GaugeMetricFamily(_P + "unavailable", "1 while the engine server a remote backend reaches does not "
                                "answer (NOT_SERVING; probed, back to serving by itself)",
                                value=sum(1 for b in backends if b.health() is HealthState.UNAVAILABLE))
        yield CounterMetricFamily(_P + "kv_events", "KV-cache events published to subscribers (SubscribeKvEvents)",
                                  value=sum(b.kv_events_published for b in backends))


LOAD = LoadCollector()
REGISTRY.register(LOAD)


def attach(backend: Backend) -> None:
    """Report this backend's load and steps from now on (Engine.start)."""
    backend.step_observer = observe_step
    LOAD.attach(backend)


def detach(backend: Backend) -> None:
    """Stop reporting a backend (Engine.close)."""
    LOAD.detach(backend)
    backend.step_observer = None
