"""The per-token relay path's shortcuts keep what they replace: the mux's sink (items taken
without a hop, in order), the ITL histogram's batched observer, the in-place Delta responses, and
the engine replica's once-per-message breaker success."""

from __future__ import annotations

import asyncio
import math
import random
from typing import Any

from prometheus_client import CollectorRegistry, Histogram

from router_svc.breaker import Breaker
from router_svc.metrics import E2E, ITL, ITL_FLUSH_EVERY, REQUESTS, TOKENS, TTFT, RequestMetrics, _ItlBatch
from router_svc.servicer import _delta_into, event_to_pb
from router_svc.types import Delta, Timings, Usage
from router_svc.upstreams import EngineReplica
from services.channels import open_channel
from services.metrics import ITL_BUCKETS
from services.proto.tokenrelay.v1 import engine_pb2, engine_pb2_grpc, inference_pb2
from services.security import PLAINTEXT
from tests.router.test_mux import _DripEngine, _merging_client, _serve, _until


async def test_a_sink_takes_items_in_order_and_what_it_declines_waits_in_the_inbox() -> None:
    server, address = await _serve(_DripEngine(tokens=30))
    channel, mux = _merging_client(address)
    try:
        inbox = mux.open("r")
        sunk: list[int] = []

        def sink(item: Any) -> bool:
            if item["finished"] or item["tokens"] == [10]:
                return False
            sunk.extend(item["tokens"])
            return True
        inbox.sink = sink
        mux.post("submit", engine_pb2.EngineRequest(request_id="r"))
        await asyncio.wait_for(_until(lambda: mux.items_received == 30), 10)
        # 0..9 taken by the sink; 10 declined, so everything after it queues behind it (merged),
        # the sink never sees a later item before an earlier one reached the consumer.
        assert sunk == list(range(10))
        items: list[Any] = list(await inbox.get_ready())
        assert [item["tokens"] for item in items] == [list(range(10, 29)), [29]]
        assert inbox.empty()
    finally:
        await mux.close()
        await channel.close()
        await server.stop(None)


def test_the_batched_itl_observer_counts_exactly_like_observe() -> None:
    registry = CollectorRegistry()
    plain = Histogram("plain", "h", ["t"], buckets=ITL_BUCKETS, registry=registry).labels("a")
    batched_child = Histogram("batched", "h", ["t"], buckets=ITL_BUCKETS, registry=registry).labels("a")
    batch = _ItlBatch(batched_child)
    assert batch._observe is None         # prometheus_client's internals are as expected: the batch path runs
    rng = random.Random(7)
    values = [*ITL_BUCKETS, 0.0, -1.0, 5.0, *(rng.random() * 0.3 for _ in range(500))]

    def samples(name: str) -> dict[str, float]:
        return {f"{s.name.removeprefix(name)}{sorted(s.labels.items())}": s.value
                for m in registry.collect() if m.name == name for s in m.samples if "created" not in s.name}
    for i, v in enumerate(values, 1):
        plain.observe(v)
        batch.observe(v)
        # what a scrape sees: every full batch, nothing of the one being counted
        assert samples("batched")["_count[('t', 'a')]"] == i - i % ITL_FLUSH_EVERY
    def same(a: dict[str, float], b: dict[str, float]) -> bool:
        # every bucket and the count exactly; the sum up to float rounding (added in batches)
        return a.keys() == b.keys() and all(a[k] == b[k] if not k.startswith("_sum") else math.isclose(a[k], b[k])
                                            for k in a)
    batch.flush()
    assert same(samples("plain"), samples("batched"))
    assert len(samples("plain")) == len(ITL_BUCKETS) + 3   # every bucket, +Inf, count, sum
    batch.flush()                                            # nothing left: adds nothing
    assert same(samples("plain"), samples("batched"))


def test_a_request_adds_its_counted_itl_samples_when_it_flushes() -> None:
    metrics = RequestMetrics("itl-flush-tenant", 2)
    child = ITL.labels("itl-flush-tenant", "normal")
    before = child._sum.get()             # type: ignore[attr-defined]
    metrics.first_token(0.0)
    for i in range(1, 11):
        metrics.delta(i * 0.01, 2)        # 10 deltas of 2 tokens, 10 ms apart: 5 ms per token
    assert child._sum.get() == before     # type: ignore[attr-defined]  # fewer than a batch: still counted here
    metrics.flush()
    assert abs(child._sum.get() - before - 10 * 0.005) < 1e-9   # type: ignore[attr-defined]


def test_a_request_records_into_the_series_of_its_own_tenant_and_priority() -> None:
    """The label children a request records into are looked up once per (tenant, priority) and kept:
    each request still lands in its own series."""
    def count(metric: Any, *labels: str) -> float:
        child = metric.labels(*labels)
        return child._sum.get() if hasattr(child, "_sum") else child._value.get()   # type: ignore[no-any-return]

    usage, timings = Usage(prompt_tokens=7, completion_tokens=3), Timings(ttft_seconds=0.25, total_seconds=0.5)
    before = {"ok": count(REQUESTS, "kept-a", "normal", "ok", "STOP"),
              "high": count(REQUESTS, "kept-a", "high", "ok", "STOP"),
              "b": count(REQUESTS, "kept-b", "normal", "ok", "STOP"),
              "failed": count(REQUESTS, "kept-a", "normal", "error", "OVERLOADED"),
              "ttft": count(TTFT, "kept-a", "normal"), "e2e": count(E2E, "kept-a", "normal"),
              "prompt": count(TOKENS, "kept-a", "prompt"), "completion": count(TOKENS, "kept-a", "completion")}
    for _ in range(3):
        RequestMetrics("kept-a", 2).done("stop", usage, timings)
    RequestMetrics("kept-a", 3).done("stop", usage, timings)
    RequestMetrics("kept-b", 2).done("stop", usage, timings)
    RequestMetrics("kept-a", 2).failed("error", "OVERLOADED")
    assert count(REQUESTS, "kept-a", "normal", "ok", "STOP") - before["ok"] == 3
    assert count(REQUESTS, "kept-a", "high", "ok", "STOP") - before["high"] == 1
    assert count(REQUESTS, "kept-b", "normal", "ok", "STOP") - before["b"] == 1
    assert count(REQUESTS, "kept-a", "normal", "error", "OVERLOADED") - before["failed"] == 1
    assert math.isclose(count(TTFT, "kept-a", "normal") - before["ttft"], 0.75)
    assert math.isclose(count(E2E, "kept-a", "normal") - before["e2e"], 1.5)
    assert count(TOKENS, "kept-a", "prompt") - before["prompt"] == 4 * 7
    assert count(TOKENS, "kept-a", "completion") - before["completion"] == 4 * 3


def test_delta_responses_built_in_place_equal_the_constructed_ones() -> None:
    for delta in (Delta("hi"), Delta("", [5, 6]), Delta(""), Delta("x", [1])):
        generate = _delta_into(inference_pb2.GenerateResponse(), delta)
        chat = _delta_into(inference_pb2.ChatResponse(), delta)
        assert generate.WhichOneof("event") == chat.WhichOneof("event") == "delta"
        fields = event_to_pb(delta)
        assert generate.SerializeToString() == inference_pb2.GenerateResponse(**fields).SerializeToString()  # type: ignore[arg-type]
        assert chat.SerializeToString() == inference_pb2.ChatResponse(**fields).SerializeToString()  # type: ignore[arg-type]


async def test_a_message_with_tokens_clears_a_suspect_replica_and_an_error_alone_does_not() -> None:
    channel = open_channel("127.0.0.1:9", PLAINTEXT)   # never connected: the replica's logic only
    replica = EngineReplica("127.0.0.1:9", channel, engine_pb2_grpc.EngineStub(channel), breaker=Breaker())
    replica.breaker.failure()
    assert not replica.breaker.clean() and not replica.healthy
    replica._on_message(engine_pb2.EngineOutbound(chunks=[engine_pb2.TokenChunk(
        request_id="a", error_reason="OVERLOADED", finished=True)]))
    assert not replica.healthy                      # a refusal is no sign that it works
    replica._on_message(engine_pb2.EngineOutbound(chunks=[
        engine_pb2.TokenChunk(request_id="a", error_reason="OVERLOADED"),
        engine_pb2.TokenChunk(request_id="b", token_ids=[1])]))
    assert replica.breaker.clean() and replica.healthy
    await replica.close()
