"""Engine observability: Prometheus metrics scraped over HTTP and `engine.generate` spans.

The Prometheus registry and the OpenTelemetry provider are process-global (other tests may have
counted requests or installed the provider first), so metric checks compare a scrape before with
one after, and spans are told apart by their request id and the parent's trace id.
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from engine_svc import telemetry
from engine_svc.app import start_metrics
from engine_svc.backends.base import FinishReason, GenerationEvent
from engine_svc.backends.sim import SimBackend, SimConfig
from engine_svc.config import EngineSettings
from engine_svc.metrics import LoadCollector
from services.channels import open_channel
from services.grpc_util import wait_healthy
from services.proto.tokenrelay.v1 import engine_pb2, engine_pb2_grpc
from services.tracing import configure_tracing, inject
from services.wire import FINISH_NAMES
from tests.engine.engine_testkit import Collector, StreamClient, engine_request, fast_sim, poll, req

REPO = pathlib.Path(__file__).resolve().parents[2]
P = "tokenrelay_engine_"


# -- fixtures and helpers -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def spans() -> Iterator[InMemorySpanExporter]:
    """An in-memory exporter on the process's tracer provider, whoever installed it."""
    exporter = InMemorySpanExporter()
    configure_tracing("engine_svc", exporter=exporter)
    yield exporter
    exporter.shutdown()  # later spans are dropped instead of piling up in memory


@pytest.fixture(scope="module")
def metrics_port(tmp_path_factory: pytest.TempPathFactory) -> int:
    """The engine's /metrics endpoint, started the way serve() starts it (one per module: the
    endpoint lives as long as the process)."""
    port_file = tmp_path_factory.mktemp("metrics") / "metrics.port"
    port = start_metrics(EngineSettings(metrics_port=0, metrics_port_file=str(port_file)))
    assert port > 0 and int(port_file.read_text()) == port
    return port


class Scrape:
    """One /metrics scrape, parsed into samples."""

    def __init__(self, text: str) -> None:
        self.samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                self.samples[(s.name, tuple(sorted(s.labels.items())))] = s.value

    def get(self, name: str, **labels: str) -> float:
        return self.samples.get((name, tuple(sorted(labels.items()))), 0.0)

    def has(self, name: str) -> bool:
        return any(key[0] == name for key in self.samples)


async def scrape(port: int) -> Scrape:
    def fetch() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            return response.read().decode()

    return Scrape(await asyncio.to_thread(fetch))  # the endpoint's collector needs the loop free



def delta(after: Scrape, before: Scrape, name: str, **labels: str) -> float:
    return after.get(name, **labels) - before.get(name, **labels)


def traced(request: engine_pb2.EngineRequest, name: str) -> trace.Span:
    """Attach the W3C context of a real (ended) parent span to the request; returns the parent."""
    with trace.get_tracer("test.router").start_as_current_span(name) as parent:
        request.trace_context.update(inject())
    return parent


def span_of(exporter: InMemorySpanExporter, request_id: str, trace_id: int | None = None) -> Any:
    found = [s for s in exporter.get_finished_spans() if s.name == telemetry.SPAN_NAME
             and s.attributes.get("tokenrelay.request_id") == request_id
             and (trace_id is None or s.context.trace_id == trace_id)]
    assert len(found) == 1, f"{len(found)} engine.generate spans for {request_id}"
    return found[0]


def assert_child_of(span: Any, parent: trace.Span) -> None:
    assert span.context.trace_id == parent.get_span_context().trace_id
    assert span.parent is not None and span.parent.span_id == parent.get_span_context().span_id
    assert span.kind == SpanKind.SERVER


# -- over gRPC, in process --------------------------------------------------------------------------
DECODE_STEP = 0.0005
PREFILL_PER_TOKEN = 1e-6


async def run_mixed_requests(stub: Any, engine: Any, metrics_port: int) -> SimpleNamespace:
    """Cold and warm (prefix-cached) requests, an EOS stop, a cancel and two rejections, each but
    one traced; returns what the client saw and scrapes from before and after."""
    before = await scrape(metrics_port)
    steps_before = engine.backend.steps
    client, other = StreamClient(stub), StreamClient(stub)
    prompt = list(range(1, 14))  # 3 full blocks of 4 + 1: the second request reuses 12 tokens
    requests = {"cold": engine_request("cold", prompt, 5), "warm": engine_request("warm", prompt, 7),
                "eos": engine_request("eos", [20, 21, 22], 16, eos=[3]),
                "long": engine_request("long", [30, 31], 4000)}  # ~2 s: aborted long before its end
    parents = {rid: traced(r, f"router.{rid}") for rid, r in requests.items() if rid != "eos"}
    # One at a time, each admitted in a step of its own, so prefill steps are countable.
    for rid in ("cold", "warm", "eos"):
        client.submit(requests[rid])
        await client.wait(rid)
    client.submit(requests["long"])
    await poll(lambda: client.tokens("long"), what="first token of the long request")
    empty = engine_request("empty", [], 4)
    dup = engine_request("long", [1, 2], 4)  # the id is live on the other stream
    rejected = {"empty": (traced(empty, "router.empty"), "EMPTY_PROMPT"),
                "long": (traced(dup, "router.dup"), "DUPLICATE_REQUEST_ID")}
    client.submit(empty)
    other.submit(dup)
    await client.wait("empty")
    await other.wait("long")
    client.abort("long")
    await poll(lambda: client.last("long").finished, what="long request cancelled")
    client.half_close()
    await client.ended()
    other.cancel()
    assert other.last("long").error_reason == "DUPLICATE_REQUEST_ID"
    return SimpleNamespace(
        before=before, after=await scrape(metrics_port), steps=engine.backend.steps - steps_before,
        requests=requests, parents=parents, rejected=rejected,
        reasons={rid: FINISH_NAMES[client.last(rid).finish_reason] for rid in requests},
        tokens={rid: client.tokens(rid) for rid in requests},
        cached={rid: client.chunks[rid][0].cached_tokens for rid in requests})


def check_request_metrics(run: SimpleNamespace) -> None:
    after, before = run.after, run.before
    for reason in ("length", "stop", "cancelled", "error"):
        expected = sum(1 for r in run.reasons.values() if r == reason)
        assert delta(after, before, P + "requests_total", finish_reason=reason) == expected, reason
    for _, reason in run.rejected.values():
        assert delta(after, before, P + "rejections_total", reason=reason) == 1, reason
    generated = sum(len(t) for t in run.tokens.values())
    prompts = sum(len(r.prompt_token_ids) for r in run.requests.values())
    cached = sum(run.cached.values())
    assert delta(after, before, P + "generated_tokens_total") == generated
    assert delta(after, before, P + "prompt_tokens_total") == prompts
    assert delta(after, before, P + "cached_tokens_total") == cached
    for histogram in ("ttft_seconds", "e2e_seconds"):
        assert delta(after, before, P + histogram + "_count") == len(run.requests), histogram
    # The sim emits one token per event: every request with a second token has a TPOT sample.
    assert delta(after, before, P + "time_per_output_token_seconds_count") == sum(
        1 for t in run.tokens.values() if len(t) > 1)
    # Step histograms hold what the cost model charged: one prefill step per request (they were
    # admitted one at a time) and one decode step per engine step.
    assert delta(after, before, P + "prefill_step_seconds_count") == len(run.requests)
    assert delta(after, before, P + "prefill_step_seconds_sum") == pytest.approx(
        PREFILL_PER_TOKEN * (prompts - cached))
    assert delta(after, before, P + "decode_step_seconds_count") == run.steps
    assert delta(after, before, P + "decode_step_seconds_sum") == pytest.approx(run.steps * DECODE_STEP)
    # Batch sizes are charged before the step's sleep; the cancelled request may be charged for
    # the step during which it was aborted, and gets no token from it.
    assert generated <= delta(after, before, P + "decode_batch_size_sum") <= generated + 1


def check_spans(run: SimpleNamespace, exporter: InMemorySpanExporter) -> None:
    for rid, parent in run.parents.items():
        span = span_of(exporter, rid, parent.get_span_context().trace_id)
        assert_child_of(span, parent)
        attrs = span.attributes
        assert attrs["tokenrelay.prompt_tokens"] == len(run.requests[rid].prompt_token_ids)
        assert attrs["tokenrelay.cached_tokens"] == run.cached[rid]
        assert attrs["tokenrelay.completion_tokens"] == len(run.tokens[rid])
        assert attrs["tokenrelay.finish_reason"] == run.reasons[rid]
        assert span.status.status_code != StatusCode.ERROR
        (first,) = [e for e in span.events if e.name == "first_token"]
        assert span.start_time <= first.timestamp <= span.end_time
    # Without a trace context the span is a root of its own trace.
    untraced = span_of(exporter, "eos")
    assert untraced.parent is None
    assert untraced.context.trace_id not in {p.get_span_context().trace_id for p in run.parents.values()}
    for rid, (parent, reason) in run.rejected.items():
        span = span_of(exporter, rid, parent.get_span_context().trace_id)
        assert_child_of(span, parent)
        assert span.status.status_code == StatusCode.ERROR
        assert span.attributes["tokenrelay.error_reason"] == reason
        assert not [e for e in span.events if e.name == "first_token"]


async def test_metrics_and_spans_count_exactly_the_requests_served(serve, metrics_port, spans) -> None:
    stub, engine = await serve(sim_eos_probability=1.0, sim_decode_step_time=DECODE_STEP,
                               sim_prefill_time_per_token=PREFILL_PER_TOKEN, sim_max_context=4096,
                               sim_num_blocks=1024)
    run = await run_mixed_requests(stub, engine, metrics_port)
    # The scenario did what it is meant to exercise.
    assert run.reasons == {"cold": "length", "warm": "length", "eos": "stop", "long": "cancelled"}
    assert run.cached == {"cold": 0, "warm": 12, "eos": 0, "long": 0}
    check_request_metrics(run)
    check_spans(run, spans)


async def test_load_gauges_follow_the_engine_and_overload_is_counted(serve, metrics_port) -> None:
    before = await scrape(metrics_port)
    stub, engine = await serve(sim_max_batch_size=2, max_queued=1, sim_decode_step_time=0.002)
    client = StreamClient(stub)
    client.submit(*(engine_request(f"r{i}", [i, i + 1, i + 2, i + 3], 400) for i in range(3)))

    async def running() -> Any:
        load = await stub.GetLoad(engine_pb2.LoadRequest())
        ok = load.active_requests == 2 and load.queued_requests == 1 and client.tokens("r0")
        return load if ok else None

    load = await poll(running, what="two requests running and one queued")
    client.submit(engine_request("over-1", [1, 2], 4), engine_request("over-2", [1, 2], 4))
    await client.wait("over-1", "over-2")
    busy = await scrape(metrics_port)
    assert delta(busy, before, P + "active_requests") == 2
    assert delta(busy, before, P + "queued_requests") == 1
    assert delta(busy, before, P + "max_active_requests") == 2
    # KV is reserved for prompt + max_tokens at admission, so it stays put while they decode.
    assert load.kv_blocks_used > 0
    assert delta(busy, before, P + "kv_blocks_used") == load.kv_blocks_used
    assert delta(busy, before, P + "kv_blocks_free") == load.kv_blocks_total - load.kv_blocks_used
    assert busy.get(P + "info", backend="sim", model=load.model) == 1
    assert delta(busy, before, P + "rejections_total", reason="OVERLOADED") == 2
    assert client.last("over-1").error_reason == "OVERLOADED"

    client.abort("r0", "r1", "r2")
    await client.wait("r0", "r1", "r2")
    idle = await scrape(metrics_port)
    for gauge in ("active_requests", "queued_requests", "kv_blocks_used"):
        assert delta(idle, before, P + gauge) == 0, gauge
    assert delta(idle, before, P + "kv_blocks_free") == load.kv_blocks_total
    # Released blocks that hold full prompt/generated blocks stay cached for reuse.
    assert engine.backend.kv.cached_blocks > 0
    assert delta(idle, before, P + "kv_blocks_cached") == engine.backend.kv.cached_blocks
    assert delta(idle, before, P + "requests_total", finish_reason="cancelled") == 3
    client.cancel()
    await engine.close()  # detached: the engine's gauges leave the scrape
    gone = await scrape(metrics_port)
    assert delta(gone, before, P + "max_active_requests") == 0
    assert delta(gone, before, P + "info", backend="sim", model=load.model) == 0


async def test_hf_backend_reports_per_request_timings_and_no_steps(serve, metrics_port, spans, tmp_path) -> None:
    pytest.importorskip("transformers")
    from tests.tiny_model import build_model

    model_dir = build_model(tmp_path / "tiny-llama", max_positions=128)
    before = await scrape(metrics_port)
    stub, _ = await serve(backend="hf", model=str(model_dir), hf_num_blocks=32, hf_block_size=16,
                               hf_max_batch_tokens=128, hf_max_batch_size=4)
    client = StreamClient(stub)
    requests = [engine_request("h1", [5, 6, 7, 8], 12, ignore_eos=True),
                engine_request("h2", [9, 10], 12, ignore_eos=True)]
    parents = {r.request_id: traced(r, f"router.{r.request_id}") for r in requests}
    client.submit(*requests)
    await client.wait("h1", "h2", timeout=60)
    after = await scrape(metrics_port)
    assert [len(client.tokens(r.request_id)) for r in requests] == [12, 12]
    assert delta(after, before, P + "requests_total", finish_reason="length") == len(requests)
    assert delta(after, before, P + "generated_tokens_total") == 24
    assert delta(after, before, P + "prompt_tokens_total") == sum(len(r.prompt_token_ids) for r in requests)
    assert delta(after, before, P + "ttft_seconds_count") == len(requests)
    # Decode cost shows per request (transformers streams its tokens over several callbacks)...
    assert 1 <= delta(after, before, P + "time_per_output_token_seconds_count") <= len(requests)
    # ...and never as steps, which the hf backend cannot see.
    assert delta(after, before, P + "decode_step_seconds_count") == 0
    assert after.get(P + "info", backend="hf", model="tiny-llama") == 1
    assert delta(after, before, P + "kv_blocks_used") + delta(after, before, P + "kv_blocks_free") == 32
    for rid, parent in parents.items():
        assert_child_of(span_of(spans, rid, parent.get_span_context().trace_id), parent)
    client.half_close()
    await client.ended(timeout=30)


# -- domain level, no network ---------------------------------------------------------------------
async def test_load_collector_reports_the_backends_own_prefix_hit_ratio() -> None:
    collector = LoadCollector()  # private to this test, so no other engine is summed in
    backend = SimBackend(fast_sim(num_blocks=64))
    await backend.start()
    try:
        sink = Collector()
        prompt = list(range(1, 18))  # 4 full blocks of 4 + 1
        backend.submit(req("a", prompt, 3), sink)
        await sink.wait("a")
        backend.submit(req("b", prompt, 3), sink)
        backend.submit(req("c", [7, 7, 7, 7, 7], 3), sink)
        await sink.wait("b", "c")
        collector.attach(backend)
        values = {s.name: s.value for m in collector.collect() for s in m.samples if not s.labels}
        kv = backend.kv
        assert kv.hit_blocks == 4 and kv.miss_blocks == 5  # a: 4, b: 0 (all hit), c: 1
        assert values[P + "prefix_cache_hit_ratio"] == kv.hit_blocks / (kv.hit_blocks + kv.miss_blocks)
        assert values[P + "kv_blocks_cached"] == kv.cached_blocks > 0
        assert values[P + "kv_blocks_free"] == 64 and values[P + "kv_blocks_used"] == 0
        assert values[P + "kv_evicted_blocks_total"] == kv.evictions
        described = {m.name for m in collector.describe()}
        assert described == {m.name for m in collector.collect()}
        collector.detach(backend)
        values = {s.name: s.value for m in collector.collect() for s in m.samples if not s.labels}
        assert values[P + "prefix_cache_hit_ratio"] == 0 and values[P + "kv_blocks_free"] == 0
    finally:
        await backend.close()


def _value(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def test_telemetry_records_an_error_finish_with_exact_timings(spans, monkeypatch) -> None:
    now = [100.0]
    monkeypatch.setattr(telemetry, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    names = ["generated_tokens_total", "prompt_tokens_total", "cached_tokens_total",
             "ttft_seconds_sum", "time_per_output_token_seconds_sum", "time_per_output_token_seconds_count",
             "e2e_seconds_sum"]
    before = {n: _value(P + n) for n in names} | {"error": _value(P + "requests_total", finish_reason="error")}
    with trace.get_tracer("test").start_as_current_span("parent") as parent:
        carrier = inject()
    request = req("unit-1", [5, 6, 7, 8, 9], 16, trace_context=carrier)
    seen: list[GenerationEvent] = []
    t = telemetry.RequestTelemetry(request, seen.append)
    events = [(100.5, GenerationEvent("unit-1", [1, 2], cached_tokens=4)), (101.0, GenerationEvent("unit-1", [3])),
              (102.5, GenerationEvent.failed("unit-1", "ENGINE_ERROR", "boom", [4]))]
    for at, event in events:
        now[0] = at
        t(event)
    assert seen == [e for _, e in events]
    assert _value(P + "requests_total", finish_reason="error") - before["error"] == 1
    assert _value(P + "generated_tokens_total") - before["generated_tokens_total"] == 4
    assert _value(P + "prompt_tokens_total") - before["prompt_tokens_total"] == 5
    assert _value(P + "cached_tokens_total") - before["cached_tokens_total"] == 4
    assert _value(P + "ttft_seconds_sum") - before["ttft_seconds_sum"] == pytest.approx(0.5)
    assert _value(P + "e2e_seconds_sum") - before["e2e_seconds_sum"] == pytest.approx(2.5)
    # Two tokens after the first event's two, over 2.0 s.
    assert _value(P + "time_per_output_token_seconds_count") - before["time_per_output_token_seconds_count"] == 1
    assert _value(P + "time_per_output_token_seconds_sum") - before["time_per_output_token_seconds_sum"] == (
        pytest.approx(1.0))
    span = span_of(spans, "unit-1", parent.get_span_context().trace_id)
    assert_child_of(span, parent)
    assert span.status.status_code == StatusCode.ERROR and "boom" in span.status.description
    assert span.attributes["tokenrelay.error_reason"] == "ENGINE_ERROR"
    assert span.attributes["tokenrelay.finish_reason"] == FinishReason.ERROR.value
    assert span.attributes["tokenrelay.completion_tokens"] == 4
    (first,) = [e for e in span.events if e.name == "first_token"]
    assert first.attributes["tokenrelay.cached_tokens"] == 4


# -- the real process ------------------------------------------------------------------------------
async def test_engine_process_serves_metrics_and_writes_spans(tmp_path: pathlib.Path, spans) -> None:
    port_file, metrics_file, trace_file = (tmp_path / n for n in ("engine.port", "metrics.port", "spans.jsonl"))
    env = {**os.environ, "TOKENRELAY_TRACE_FILE": str(trace_file)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "engine_svc", "--backend", "sim", "--port", "0", "--port-file", str(port_file),
        "--metrics-port", "0", "--metrics-port-file", str(metrics_file), "--sim-vocab-size", "5000",
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        port = await poll(lambda: port_file.exists() and port_file.read_text().strip(), timeout=30,
                          what="port file")
        metrics_port = int(metrics_file.read_text())  # written before the server's port file
        address = f"127.0.0.1:{int(port)}"
        await wait_healthy(address, timeout=10)
        async with open_channel(address) as channel:
            client = StreamClient(engine_pb2_grpc.EngineStub(channel))
            requests = [engine_request("p1", [1, 2, 3], 20), engine_request("p2", [4, 5], 9)]
            parents = {r.request_id: traced(r, f"router.{r.request_id}") for r in requests}
            client.submit(*requests)
            await client.wait("p1", "p2", timeout=20)
            metrics = await scrape(metrics_port)
            client.half_close()
            await client.ended()
        proc.send_signal(signal.SIGTERM)
        _, err = await asyncio.wait_for(proc.communicate(), timeout=30)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, err.decode()
    # A fresh process: totals are exactly these two requests.
    assert metrics.get(P + "requests_total", finish_reason="length") == len(requests)
    generated = [len(client.tokens(r.request_id)) for r in requests]
    assert generated == [r.sampling.max_tokens for r in requests]
    assert metrics.get(P + "generated_tokens_total") == sum(generated)
    assert metrics.get(P + "prompt_tokens_total") == sum(len(r.prompt_token_ids) for r in requests)
    assert metrics.get(P + "ttft_seconds_count") == len(requests)
    assert metrics.get(P + "info", backend="sim", model=SimConfig().model) == 1
    assert metrics.has(P + "kv_blocks_free") and metrics.has(P + "decode_step_seconds_bucket")
    events = [json.loads(line) for line in err.decode().splitlines() if line.startswith("{")]
    (listening,) = [e for e in events if e.get("event") == "listening"]
    assert listening["metrics_port"] == metrics_port
    written = [json.loads(line) for line in trace_file.read_text().splitlines()]
    for rid, parent in parents.items():
        (span,) = [s for s in written if s["name"] == "engine.generate"
                   and s["attributes"]["tokenrelay.request_id"] == rid]
        ctx = parent.get_span_context()
        assert span["trace_id"] == format(ctx.trace_id, "032x")
        assert span["parent_id"] == format(ctx.span_id, "016x")
        assert span["service"] == "engine_svc"
        assert span["attributes"]["tokenrelay.completion_tokens"] == len(client.tokens(rid))
        assert span["attributes"]["tokenrelay.finish_reason"] == "length"
