"""Traces (the caller's context is the parent; per request on multiplexed streams) and metrics."""

from __future__ import annotations

import asyncio
import gc
import pathlib
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import REGISTRY

from services.channels import open_channel
from services.proto.tokenrelay.v1 import common_pb2, tokenizer_pb2_grpc
from services.proto.tokenrelay.v1 import tokenizer_pb2 as pb
from services.tracing import configure_tracing, inject
from tokenizer_svc.app import TokenizerApp
from tokenizer_svc.config import TokenizerSettings


@pytest.fixture(scope="module")
def spans() -> Iterator[InMemorySpanExporter]:
    """An in-memory exporter on the process's tracer provider, whoever installed it."""
    exporter = InMemorySpanExporter()
    configure_tracing("tokenizer_svc", exporter=exporter)
    yield exporter
    exporter.shutdown()  # later spans are dropped instead of piling up in memory


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def wait_for(predicate: Any, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        gc.collect()
        await asyncio.sleep(0.01)


async def test_spans_follow_the_callers_context(tiny_dirs: dict[str, pathlib.Path],
                                                spans: InMemorySpanExporter) -> None:
    app = TokenizerApp(TokenizerSettings(tokenizer=str(tiny_dirs["tiny-sentencepiece"]), port=0, workers=1))
    await app.start()
    tracer = trace.get_tracer("test")
    try:
        async with open_channel(app.address) as channel:
            stub = tokenizer_pb2_grpc.TokenizerStub(channel)
            with tracer.start_as_current_span("client-tokenize") as client:
                await stub.Tokenize(pb.TokenizeRequest(inputs=[pb.TokenizeInput(text="hi")]),
                                    metadata=tuple(inject().items()))
            tokenize_trace = client.get_span_context().trace_id
            call = stub.Detokenize()
            contexts = {}
            for rid in ("a", "b", "left-open"):
                with tracer.start_as_current_span(f"client-{rid}") as span:
                    contexts[rid] = (span.get_span_context().trace_id, inject())
            ids = list(app.encoder.tokenizer.tokenizer.encode(  # type: ignore[union-attr]
                "one two three", add_special_tokens=False).ids)
            await call.write(pb.DetokenizeRequest(
                open=[pb.DetokOpen(request_id=rid, stop=["two"] if rid == "a" else [], trace_context=ctx)
                      for rid, (_, ctx) in contexts.items()],
                tokens=[pb.DetokTokens(request_id="a", token_ids=ids),
                        pb.DetokTokens(request_id="b", token_ids=ids, final=True)]))
            await call.read()
            await call.done_writing()
            assert await call.read() == grpc.aio.EOF
    finally:
        await app.stop()

    def named(name: str) -> list[Any]:
        return [s for s in spans.get_finished_spans() if s.name == name]

    await wait_for(lambda: len(named("tokenizer.detokenize")) == 3)
    (tok_span,) = named("tokenizer.tokenize")
    assert tok_span.context.trace_id == tokenize_trace
    by_id = {s.attributes["tokenrelay.request_id"]: s for s in named("tokenizer.detokenize")}
    for rid, (trace_id, _) in contexts.items():
        assert by_id[rid].context.trace_id == trace_id   # each request in its own trace
    assert by_id["a"].attributes["tokenrelay.outcome"] == "stopped"
    assert by_id["b"].attributes["tokenrelay.outcome"] == "finished"
    assert by_id["left-open"].attributes["tokenrelay.outcome"] == "abandoned"


async def test_metrics_count_calls_tokens_and_outcomes(tiny_dirs: dict[str, pathlib.Path]) -> None:
    before = {
        "text": sample("tokenrelay_tokenizer_tokenize_inputs_total", kind="text"),
        "chat": sample("tokenrelay_tokenizer_tokenize_inputs_total", kind="chat"),
        "empty": sample("tokenrelay_tokenizer_tokenize_rejections_total", reason="EMPTY_PROMPT"),
        "tokens": sample("tokenrelay_tokenizer_tokenize_tokens_total"),
        "detok": sample("tokenrelay_tokenizer_detok_tokens_total"),
        "closed": sample("tokenrelay_tokenizer_detok_requests_total", outcome="closed"),
        "busy": sample("tokenrelay_tokenizer_tokenize_busy_seconds_total"),
    }
    app = TokenizerApp(TokenizerSettings(tokenizer=str(tiny_dirs["tiny-sentencepiece"]), port=0, workers=1))
    await app.start()
    try:
        async with open_channel(app.address) as channel:
            stub = tokenizer_pb2_grpc.TokenizerStub(channel)
            chat = pb.TokenizeInput(chat=pb.ChatMessages(messages=[common_pb2.ChatMessage(role="user", content="x")]))
            resp = await stub.Tokenize(pb.TokenizeRequest(inputs=[pb.TokenizeInput(text="a b"), chat]))
            assert sample("tokenrelay_tokenizer_tokenize_workers") >= 1
            with pytest.raises(Exception):  # noqa: B017 - the code is checked elsewhere; here its count
                await stub.Tokenize(pb.TokenizeRequest())
            call = stub.Detokenize()
            await call.write(pb.DetokenizeRequest(open=[pb.DetokOpen(request_id="r")],
                                                  tokens=[pb.DetokTokens(request_id="r", token_ids=[5, 6, 7])]))
            await call.read()
            await wait_for(lambda: sample("tokenrelay_tokenizer_detok_open_requests") >= 1)
            await call.write(pb.DetokenizeRequest(close=[pb.DetokClose(request_id="r")]))
            await call.done_writing()
            assert await call.read() == grpc.aio.EOF
    finally:
        await app.stop()
    assert sample("tokenrelay_tokenizer_tokenize_inputs_total", kind="text") == before["text"] + 1
    assert sample("tokenrelay_tokenizer_tokenize_inputs_total", kind="chat") == before["chat"] + 1
    assert sample("tokenrelay_tokenizer_tokenize_rejections_total", reason="EMPTY_PROMPT") == before["empty"] + 1
    assert sample("tokenrelay_tokenizer_tokenize_tokens_total") == before["tokens"] + sum(
        len(r.ids) for r in resp.results)
    assert sample("tokenrelay_tokenizer_detok_tokens_total") == before["detok"] + 3
    assert sample("tokenrelay_tokenizer_tokenize_busy_seconds_total") > before["busy"]
    assert sample("tokenrelay_tokenizer_detok_requests_total", outcome="closed") == before["closed"] + 1
    await wait_for(lambda: sample("tokenrelay_tokenizer_detok_open_requests") == 0)
