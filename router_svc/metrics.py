"""Router metrics (Prometheus): latency histograms by tenant and priority, outcomes by reason.

ITL is observed once per delta as (gap since previous delta) / (tokens in this delta): deltas
are coalesced, so this is the per-token latency the client experiences, without one sample per
token on the hot path.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from services.metrics import ITL_BUCKETS, LATENCY_BUCKETS

from .types import Timings, Usage

PRIORITY_NAMES = {0: "default", 1: "low", 2: "normal", 3: "high"}
_L = ("tenant", "priority")

REQUESTS = Counter("tokenrelay_router_requests_total", "Finished requests by outcome and reason",
                   [*_L, "outcome", "reason"])
TTFT = Histogram("tokenrelay_router_ttft_seconds", "Request received to first token sent", _L,
                 buckets=LATENCY_BUCKETS)
ITL = Histogram("tokenrelay_router_inter_token_seconds", "Per-token latency between streamed deltas", _L,
                buckets=ITL_BUCKETS)
E2E = Histogram("tokenrelay_router_e2e_seconds", "Request received to done", _L, buckets=LATENCY_BUCKETS)
QUEUE = Histogram("tokenrelay_router_queue_seconds", "Admission wait", _L, buckets=LATENCY_BUCKETS)
TOKENIZE = Histogram("tokenrelay_router_tokenize_seconds", "Tokenize call latency seen by the router",
                     buckets=LATENCY_BUCKETS)
IN_FLIGHT = Gauge("tokenrelay_router_in_flight", "Requests being served by this router", ["tenant"])
QUEUED = Gauge("tokenrelay_router_queued", "Requests of this router waiting for admission", ["tenant"])
TOKENS = Counter("tokenrelay_router_tokens_total", "Tokens by kind (prompt, cached, completion)",
                 ["tenant", "kind"])
TENANTS_RELOADS = Counter("tokenrelay_router_tenants_reloads_total",
                          "Reloads of the tenants file by outcome (ok = swapped in, failed = old kept)",
                          ["outcome"])
TENANTS = Gauge("tokenrelay_router_tenants", "Tenants in the registry being served")


class RequestMetrics:
    """Per-request recorder; cheap enough for the hot path (label children are cached)."""

    def __init__(self, tenant: str, priority: int) -> None:
        self.labels = (tenant, PRIORITY_NAMES.get(priority, str(priority)))
        self._itl = ITL.labels(*self.labels)
        self._last: float | None = None

    def first_token(self, now: float) -> None:
        self._last = now

    def delta(self, now: float, tokens: int) -> None:
        if self._last is not None and tokens > 0:
            self._itl.observe((now - self._last) / tokens)
        self._last = now

    def done(self, reason: str, usage: Usage, t: Timings) -> None:
        REQUESTS.labels(*self.labels, "ok" if reason != "cancelled" else "cancelled", reason.upper()).inc()
        TTFT.labels(*self.labels).observe(t.ttft_seconds)
        E2E.labels(*self.labels).observe(t.total_seconds)
        QUEUE.labels(*self.labels).observe(t.queue_seconds)
        TOKENIZE.observe(t.tokenize_seconds)
        tenant = self.labels[0]
        TOKENS.labels(tenant, "prompt").inc(usage.prompt_tokens)
        TOKENS.labels(tenant, "cached").inc(usage.cached_tokens)
        TOKENS.labels(tenant, "completion").inc(usage.completion_tokens)

    def failed(self, outcome: str, reason: str) -> None:
        REQUESTS.labels(*self.labels, outcome, reason).inc()
