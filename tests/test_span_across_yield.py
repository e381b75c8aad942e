"""A span held across a `yield` of an async generator must never be attached to the context.

bench/probe_mix.py found it (its `flood` action: a tenant's requests queued, then cut): the
router's `_queued` (router_svc/pipeline.py) held a span made current (`child_span`) across its
`yield Accepted(...)`. A generator left suspended there by a client that went away is closed
later, by the event loop's async-generator finalizer, in another Context; OpenTelemetry's
detach of the token then fails and logs "Failed to detach context" as an ERROR with a traceback.
`detached_span` is a child of an explicit context that is never made current. The second test
keeps it so: no `with child_span(...)` block in the services' code contains a `yield`."""

from __future__ import annotations

import ast
import asyncio
import contextvars
import logging
import pathlib

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.tracing import child_span, detached_span

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture
def spans():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider.get_tracer("t"), exporter


def _closed_elsewhere(gen) -> None:   # type: ignore[no-untyped-def]
    """Suspend `gen` at its first yield, then close it from another Context (as the finalizer does)."""
    async def run() -> None:
        await gen.__anext__()
        await asyncio.create_task(gen.aclose(), context=contextvars.Context())
    asyncio.run(run())


def test_a_detached_span_survives_its_generator_being_closed_in_another_context(spans, caplog) -> None:
    tr, exporter = spans
    parent = trace.set_span_in_context(tr.start_span("root"))

    async def current():   # type: ignore[no-untyped-def]
        with child_span(tr, "queued", context=parent):
            yield 1

    async def detached():   # type: ignore[no-untyped-def]
        with detached_span(tr, "queued", context=parent):
            yield 1

    caplog.set_level(logging.ERROR, logger="opentelemetry.context")
    _closed_elsewhere(current())
    assert "Failed to detach context" in caplog.text      # the defect, with a span made current
    caplog.clear()
    exporter.clear()
    _closed_elsewhere(detached())
    assert caplog.text == ""
    (span,) = exporter.get_finished_spans()
    assert span.name == "queued" and span.parent.span_id == trace.get_current_span(parent).get_span_context().span_id


def test_detached_span_marks_an_error_and_ends(spans) -> None:
    tr, exporter = spans
    with pytest.raises(ValueError), detached_span(tr, "x", context=None):
        raise ValueError("bad")
    (span,) = exporter.get_finished_spans()
    assert span.status.status_code == trace.StatusCode.ERROR and not span.events


def _yields_inside_child_span(tree: ast.AST) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.With, ast.AsyncWith)) and any(
                isinstance(item.context_expr, ast.Call) and getattr(item.context_expr.func, "id", "") == "child_span"
                for item in node.items):
            body = ast.Module(body=node.body, type_ignores=[])
            lines += [n.lineno for n in ast.walk(body) if isinstance(n, (ast.Yield, ast.YieldFrom))]
    return lines


def test_no_span_made_current_is_held_across_a_yield() -> None:
    found = []
    for package in ("router_svc", "engine_svc", "tokenizer_svc", "services"):
        for path in (REPO / package).rglob("*.py"):
            lines = _yields_inside_child_span(ast.parse(path.read_text()))
            found += [f"{path.relative_to(REPO)}:{line}" for line in lines]
    assert found == []
