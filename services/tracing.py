"""OpenTelemetry setup and context propagation for every service.

Context crosses process boundaries in W3C `traceparent`/`tracestate` form: in gRPC metadata for
ordinary calls (`ServerTracingInterceptor` extracts it on the server), and per request inside
multiplexed stream messages (`inject()` / `extract()` on a plain dict), because one stream
carries many requests. Spans are exported over OTLP when an endpoint is configured, to a JSON-lines
file with `--trace-file`, to an in-memory exporter in tests, and nowhere otherwise.

A process that exports nowhere records no span it starts itself (`_ExportingSampler`): its spans
are the SDK's non-recording ones, which still carry fresh trace and span ids (the logs' `trace_id`),
at about a third of a recorded span's cost (13.7 against 39.3 us for a root and a child, measured
on the 2-core machine). Below such a root no child span is started at all (`child_span`,
`start_span`, `detached_span`): the block runs in the parent's context, whose ids outgoing calls
carry. Such a root is passed on as "not sampled", so give the exporter to the service where traces
start (the router; `tokenrelay up` and the deployments give every service the same telemetry
settings). A sampled parent from another process is still followed, children and all.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import threading
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, Decision, ParentBased, Sampler, SamplingResult

_provider: TracerProvider | None = None   # installed once per process
_NO_PARENT = otel_context.Context()            # no span in it: a child of it is not recorded here
_exporting = False                         # a span processor (exporter) is attached to it


class _ExportingSampler(Sampler):
    """The SDK's default (parent-based, always on) while this process exports spans somewhere;
    before that, a span without a sampled parent is not recorded (module doc)."""

    _default = ParentBased(ALWAYS_ON)
    _drop = SamplingResult(Decision.DROP)

    def should_sample(self, parent_context: Any, trace_id: int, name: str, kind: Any = None,
                      attributes: Any = None, links: Any = None, trace_state: Any = None) -> SamplingResult:
        if not _exporting:
            parent = trace.get_current_span(parent_context).get_span_context()
            if not (parent.is_valid and parent.trace_flags.sampled):
                return self._drop
        return self._default.should_sample(parent_context, trace_id, name, kind, attributes, links, trace_state)

    def get_description(self) -> str:
        return "ExportingSampler"


class JsonlSpanExporter(SpanExporter):
    """Appends finished spans as JSON lines to a file (debugging, and tests across processes)."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._lock = threading.Lock()
        self._file: Any = None       # opened on the first export, kept open (one write per span)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = []
        for span in spans:
            ctx, parent = span.context, span.parent
            lines.append(json.dumps({
                "name": span.name, "trace_id": format(ctx.trace_id, "032x"), "span_id": format(ctx.span_id, "016x"),
                "parent_id": format(parent.span_id, "016x") if parent else None,
                "service": span.resource.attributes.get("service.name"), "start": span.start_time,
                "end": span.end_time, "attributes": dict(span.attributes or {}),
                "events": [{"name": e.name, "t": e.timestamp} for e in span.events],
                "status": span.status.status_code.name}))
        with self._lock:
            if self._file is None:
                self._file = open(self._path, "a")   # kept open until shutdown
            self._file.write("".join(line + "\n" for line in lines))
            self._file.flush()
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def configure_tracing(service: str, otlp_endpoint: str = "", exporter: SpanExporter | None = None,
                      trace_file: str = "") -> None:
    """Install the global tracer provider once per process.

    ``trace_file`` (each service's ``--trace-file``) appends spans as JSON lines. A later call only
    adds its ``exporter`` to the provider already installed (tests attach in-memory exporters).
    """
    global _provider
    if _provider is not None:
        if exporter is not None:
            _export(_provider, SimpleSpanProcessor(exporter))
        return
    provider = TracerProvider(resource=Resource.create({"service.name": service}), sampler=_ExportingSampler())
    if trace_file:
        _export(provider, SimpleSpanProcessor(JsonlSpanExporter(trace_file)))
    if exporter is not None:
        _export(provider, SimpleSpanProcessor(exporter))
    elif otlp_endpoint:
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError as exc:  # pragma: no cover - depends on the optional extra
            raise SystemExit("OTLP export needs `pip install tokenrelay[otlp]`") from exc
        _export(provider, BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_endpoint, insecure=True)))
    trace.set_tracer_provider(provider)
    _provider = provider


def _export(provider: TracerProvider, processor: SpanProcessor) -> None:
    """Attach an exporting processor: from now on this process records the spans it starts."""
    global _exporting
    provider.add_span_processor(processor)
    _exporting = True


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def _parent_decides(tr: trace.Tracer) -> bool:
    """Does only a sampled parent make `tr` record a span? True with this module's sampler
    (`configure_tracing`'s provider) while this process exports nothing; a tracer of any other
    provider (tests') is asked as it always was (False)."""
    if _exporting:
        return False
    real = getattr(tr, "_tracer", tr)      # a ProxyTracer (`tracer()` before the provider was set) resolves
    return isinstance(getattr(real, "sampler", None), _ExportingSampler)


def _records(tr: trace.Tracer, context: otel_context.Context | None) -> bool:
    """Would `tr` record a child of `context` (None: the current one)? With this module's sampler,
    only while this process exports spans or under a sampled parent (one from another process)."""
    if not _parent_decides(tr):
        return True
    return bool(trace.get_current_span(context).get_span_context().trace_flags.sampled)


def child_span(tr: trace.Tracer, name: str, *, context: otel_context.Context | None = None, **kw: Any) -> Any:
    """A child span made current for a `with` block. An exception leaving it sets the span's
    status but is not recorded as an event: OpenTelemetry's default formats the whole traceback,
    which profiled at ~8% of a router's loop when refusals (typed errors) are frequent.

    When it would not be recorded (`_records`), no span is made: the block runs with the parent's
    context current (outgoing calls inject the parent's ids, the logs keep its trace id) and gets the
    parent's non-recording span. An unrecorded child's own ids reach nothing, and starting one cost
    ~10-15 us (the sampler, two random ids, a context attach), seven times per request in the router."""
    if not _records(tr, context):
        return _parent_current(context)
    return tr.start_as_current_span(name, context=context, record_exception=False, **kw)


@contextlib.contextmanager
def _parent_current(context: otel_context.Context | None) -> Iterator[trace.Span]:
    token = otel_context.attach(context) if context is not None else None
    try:
        yield trace.get_current_span(context)
    finally:
        if token is not None:
            otel_context.detach(token)


def start_span(tr: trace.Tracer, name: str, *, context: otel_context.Context | None = None, **kw: Any) -> trace.Span:
    """`tr.start_span`, or the parent's own non-recording span when the child would not be recorded
    (`child_span`): ending it, or adding to it, does nothing."""
    if not _records(tr, context):
        return trace.get_current_span(context)
    return tr.start_span(name, context=context, **kw)


@contextlib.contextmanager
def detached_span(tr: trace.Tracer, name: str, *, context: otel_context.Context | None) -> Iterator[trace.Span]:
    """A child span of `context` that is never made current, for a block that yields inside an
    async generator: such a generator may be closed from another task's Context (a client gone
    while it was suspended, finalized by the loop), where detaching a token attached here fails
    and OpenTelemetry logs "Failed to detach context" as an error (tests/test_span_across_yield.py).
    An exception leaving it sets the span's status, like `child_span`; unrecorded, it is the parent's
    non-recording span (`start_span`)."""
    span = start_span(tr, name, context=context)
    try:
        yield span
    except Exception as exc:
        span.set_status(trace.Status(trace.StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        raise
    finally:
        span.end()


def inject(ctx: otel_context.Context | None = None) -> dict[str, str]:
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=ctx)
    return carrier


def extract(carrier: Mapping[str, str]) -> otel_context.Context:
    return propagate.extract(dict(carrier))


def recorded_parent(tr: trace.Tracer, carrier: Mapping[str, str]) -> otel_context.Context | None:
    """The context in `carrier` (`extract`; None for an empty one) when `tr` may record a child of
    it; an empty context when it would not (`_records`: this process exports nothing and the
    carrier's W3C parent is not sampled), read from the header's flags without extracting it: a
    child started under either is not recorded (`start_span` gives a non-recording span). The
    extract cost ~20-40 us on a request's path (the router's local detokenizer opens a session
    per request)."""
    if not carrier:
        return None
    if _parent_decides(tr):
        try:
            sampled = int(carrier.get("traceparent", "")[-2:], 16) & 1
        except ValueError:
            sampled = 0
        if not sampled:
            return _NO_PARENT
    return extract(carrier)


def outgoing_metadata(extra: tuple[tuple[str, str], ...] = ()) -> tuple[tuple[str, str], ...]:
    return (*extra, *inject().items())


class ServerTracingInterceptor(grpc.aio.ServerInterceptor):
    """Makes the caller's trace context current for the handler (unary and streaming alike)."""

    async def intercept_service(self, continuation: Callable[..., Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None:
            return None
        carrier = {k: v for k, v in (details.invocation_metadata or ()) if isinstance(v, str)}
        if "traceparent" not in carrier:
            return handler
        ctx = extract(carrier)

        def wrap(fn: Callable[..., Any], streaming: bool) -> Callable[..., Any]:
            if streaming and inspect.isasyncgenfunction(fn):
                async def gen(request: Any, context: Any) -> Any:
                    # Attached and detached around each step, never across a yield: a generator
                    # closed by a cancelled client is finalized in another context, where a detach
                    # of a token from this one fails ("Failed to detach context").
                    inner = fn(request, context)
                    try:
                        while True:
                            token = otel_context.attach(ctx)
                            try:
                                item = await inner.__anext__()
                            except StopAsyncIteration:
                                return
                            finally:
                                otel_context.detach(token)
                            yield item
                    finally:
                        await inner.aclose()
                return gen
            # unary handlers, and streaming ones that write with `context.write` (health Watch)

            async def unary(request: Any, context: Any) -> Any:
                token = otel_context.attach(ctx)
                try:
                    return await fn(request, context)
                finally:
                    otel_context.detach(token)
            return unary

        for kind, streaming in (("unary_unary", False), ("stream_unary", False),
                                ("unary_stream", True), ("stream_stream", True)):
            fn = getattr(handler, kind)
            if fn is not None:
                return handler._replace(**{kind: wrap(fn, streaming)})
        return handler
