"""A process that exports spans nowhere records none it starts itself, yet its spans keep ids for the
logs; one that exports records them; a sampled parent from another process is always followed."""

from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from services import tracing


def _provider() -> tuple[trace.Tracer, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=tracing._ExportingSampler())
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider.get_tracer("t"), exporter


def test_nothing_recorded_while_nothing_exports(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tracing, "_exporting", False)
    tracer, exporter = _provider()
    root = tracer.start_span("root")
    with tracer.start_as_current_span("child", context=trace.set_span_in_context(root)) as child:
        assert not child.is_recording()
        assert child.get_span_context().trace_id == root.get_span_context().trace_id
    root.end()
    assert not root.is_recording()
    assert root.get_span_context().is_valid            # the logs' trace_id still exists
    assert not root.get_span_context().trace_flags.sampled
    assert exporter.get_finished_spans() == ()


def test_recorded_once_an_exporter_is_attached(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tracing, "_exporting", True)
    tracer, exporter = _provider()
    root = tracer.start_span("root")
    with tracer.start_as_current_span("child", context=trace.set_span_in_context(root)):
        pass
    root.end()
    assert [s.name for s in exporter.get_finished_spans()] == ["child", "root"]


@pytest.mark.parametrize("sampled", [True, False])
def test_a_remote_parent_decides_when_nothing_exports_here(monkeypatch: pytest.MonkeyPatch, sampled: bool) -> None:
    monkeypatch.setattr(tracing, "_exporting", False)
    tracer, exporter = _provider()
    flags = TraceFlags(TraceFlags.SAMPLED if sampled else TraceFlags.DEFAULT)
    parent = NonRecordingSpan(SpanContext(0x1234, 0x5678, is_remote=True, trace_flags=flags))
    with tracer.start_as_current_span("child", context=trace.set_span_in_context(parent)) as child:
        assert child.is_recording() is sampled
        assert child.get_span_context().trace_id == 0x1234
    assert len(exporter.get_finished_spans()) == (1 if sampled else 0)


def test_configure_tracing_turns_recording_on_with_an_exporter(monkeypatch: pytest.MonkeyPatch) -> None:
    """A later `configure_tracing(exporter=...)` (how tests attach) switches this process to recording."""
    monkeypatch.setattr(tracing, "_exporting", False)
    provider = TracerProvider(sampler=tracing._ExportingSampler())
    monkeypatch.setattr(tracing, "_provider", provider)
    exporter = InMemorySpanExporter()
    tracing.configure_tracing("x", exporter=exporter)
    assert tracing._exporting
    with provider.get_tracer("t").start_as_current_span("s") as span:
        assert span.is_recording()
    assert [s.name for s in exporter.get_finished_spans()] == ["s"]


def test_no_child_span_is_made_where_none_would_be_recorded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing exports and the parent does not record: `child_span`, `start_span` and `detached_span`
    start no span (none is finished, none has ids of its own); the block runs with the parent's context
    current, so an outgoing call injects the parent's ids and the logs keep its trace id."""
    monkeypatch.setattr(tracing, "_exporting", False)
    tracer, exporter = _provider()
    started: list[str] = []
    real_start = tracer.start_span
    monkeypatch.setattr(tracer, "start_span", lambda name, *a, **kw: started.append(name) or real_start(name, *a, **kw))
    root = tracer.start_span("root")
    ctx = trace.set_span_in_context(root)
    with tracing.child_span(tracer, "child", context=ctx) as child:
        assert child is root and trace.get_current_span() is root
        assert tracing.inject()["traceparent"].split("-")[2] == format(root.get_span_context().span_id, "016x")
    assert trace.get_current_span() is not root                   # the parent's context is detached again
    assert tracing.start_span(tracer, "phase", context=ctx) is root
    with tracing.detached_span(tracer, "queued", context=ctx) as queued:
        assert queued is root
    assert started == ["root"] and exporter.get_finished_spans() == ()


@pytest.mark.parametrize("exporting", [True, False])
def test_child_spans_are_made_where_they_are_recorded(monkeypatch: pytest.MonkeyPatch, exporting: bool) -> None:
    """This process exports, or (exporting nothing) a sampled parent from another process: children as before."""
    monkeypatch.setattr(tracing, "_exporting", exporting)
    tracer, exporter = _provider()
    parent = NonRecordingSpan(SpanContext(0x1234, 0x5678, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED)))
    ctx = trace.set_span_in_context(parent)
    with tracing.child_span(tracer, "child", context=ctx) as child:
        assert child.is_recording() and child.get_span_context().trace_id == 0x1234
    tracing.start_span(tracer, "phase", context=ctx).end()
    with tracing.detached_span(tracer, "queued", context=ctx):
        pass
    assert [s.name for s in exporter.get_finished_spans()] == ["child", "phase", "queued"]


@pytest.mark.parametrize("exporting", [False, True])
@pytest.mark.parametrize("sampled", [True, False])
def test_recorded_parent_skips_the_extract_only_where_no_child_would_be_recorded(
        monkeypatch: pytest.MonkeyPatch, exporting: bool, sampled: bool) -> None:
    """`recorded_parent` (the detokenizer's session open): a child under what it returns is recorded
    exactly as one under the extracted carrier would be, and the stream's own current span (sampled
    here) never becomes the parent of an unsampled request's child."""
    monkeypatch.setattr(tracing, "_exporting", exporting)
    tracer, exporter = _provider()
    flags = "01" if sampled else "00"
    carrier = {"traceparent": f"00-{0x1234:032x}-{0x5678:016x}-{flags}"}
    stream = NonRecordingSpan(SpanContext(0x9999, 0x1111, is_remote=True,
                                          trace_flags=TraceFlags(TraceFlags.SAMPLED)))
    with trace.use_span(stream):
        via_extract = tracing.start_span(tracer, "a", context=tracing.extract(carrier))
        via_helper = tracing.start_span(tracer, "b", context=tracing.recorded_parent(tracer, carrier))
    assert via_helper.is_recording() == via_extract.is_recording() == sampled   # the parent decides
    if via_helper.is_recording():
        assert via_helper.get_span_context().trace_id == 0x1234
    via_extract.end()
    via_helper.end()
    assert len(exporter.get_finished_spans()) == (2 if sampled else 0)
    assert tracing.recorded_parent(tracer, {}) is None
    assert tracing.recorded_parent(tracer, {"traceparent": "garbage"}) is not None
