"""Per-request observability: the `engine.generate` span and the request's metrics, both recorded
from the request's own event stream.

A `RequestTelemetry` is created when a request arrives on a stream and is the sink the backend
calls (it forwards every event to the stream's sink after recording it). The span's parent is
the caller's W3C context carried in ``GenerationRequest.trace_context`` — one multiplexed stream
carries requests of many traces, so the stream's own metadata cannot be the parent; without one
the span falls back to the current context (the stream's, if its caller sent one). The span
starts at submit, gets a ``first_token`` event, and ends at the finish event; ERROR finishes and
rejections set an error status.

Timings are taken where the backend calls the sink, so they are the engine's view: queueing,
prefill and decode, without the network or the router.
"""

from __future__ import annotations

import time

from opentelemetry.trace import SpanKind, Status, StatusCode

from services.tracing import extract, tracer

from . import metrics
from .backends.base import FinishReason, GenerationEvent, GenerationRequest, Sink

_tracer = tracer("tokenrelay.engine")
SPAN_NAME = "engine.generate"


class RequestTelemetry:
    """Sink wrapper that records one request's span and metrics; call `rejected` instead when
    the request never enters the engine."""

    __slots__ = ("_cached", "_first", "_first_tokens", "_generated", "_last", "_prompt", "_sink", "_span",
                 "_start")

    def __init__(self, request: GenerationRequest, sink: Sink) -> None:
        self._sink = sink
        self._start = time.perf_counter()
        self._prompt = len(request.prompt_token_ids)
        self._cached = 0
        self._generated = 0
        self._first_tokens = 0
        self._first = 0.0
        self._last = 0.0
        parent = extract(request.trace_context) if request.trace_context else None
        self._span = _tracer.start_span(SPAN_NAME, context=parent, kind=SpanKind.SERVER, attributes={
            "tokenrelay.request_id": request.request_id, "tokenrelay.prompt_tokens": self._prompt,
            "tokenrelay.max_tokens": request.max_tokens})

    def __call__(self, event: GenerationEvent) -> None:
        n = len(event.token_ids)
        if n:
            now = time.perf_counter()
            if not self._generated:
                self._first_token(now, n, event.cached_tokens)
            self._generated += n
            self._last = now
            metrics.GENERATED_TOKENS.inc(n)
        if event.finished:
            self._finish(event)
        self._sink(event)

    def _first_token(self, now: float, n: int, cached: int) -> None:
        self._first = now
        self._first_tokens = n
        self._cached = cached
        metrics.TTFT.observe(now - self._start)
        metrics.PROMPT_TOKENS.inc(self._prompt)
        if cached:
            metrics.CACHED_TOKENS.inc(cached)
        self._span.add_event("first_token", {"tokenrelay.cached_tokens": cached})

    def _finish(self, event: GenerationEvent) -> None:
        reason = event.finish_reason or FinishReason.ERROR
        metrics.FINISHED[reason].inc()
        metrics.E2E.observe(time.perf_counter() - self._start)
        # Tokens after the first event over the time they took; an engine that coalesces several
        # tokens into one event is not credited with the first event's extra tokens.
        later = self._generated - self._first_tokens
        if later > 0:
            metrics.TPOT.observe((self._last - self._first) / later)
        span = self._span
        span.set_attributes({"tokenrelay.cached_tokens": self._cached,
                             "tokenrelay.completion_tokens": self._generated,
                             "tokenrelay.finish_reason": reason.value})
        if reason is FinishReason.ERROR:
            self._fail(event.error_reason, event.error_message)
        span.end()

    def rejected(self, reason: str, message: str) -> None:
        """The request was refused at submit: count it and end its span as an error."""
        metrics.count_rejection(reason)
        self._span.set_attributes({"tokenrelay.finish_reason": FinishReason.ERROR.value,
                                   "tokenrelay.completion_tokens": 0, "tokenrelay.rejected": True})
        self._fail(reason, message)
        self._span.end()

    def _fail(self, reason: str, message: str) -> None:
        self._span.set_attribute("tokenrelay.error_reason", reason)
        self._span.set_status(Status(StatusCode.ERROR, f"{reason}: {message}" if message else reason))
