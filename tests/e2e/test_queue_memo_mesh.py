"""A tenant whose queue is full, through real router processes sharing one Redis: once Redis has
reported the queue full to a router, that router refuses the tenant's next requests by itself
(`--queue-memo-ms`, router_svc/queue_memo.py) with TENANT_QUEUE_FULL and a retry-after, without an
ENQUEUE round trip each; a router with the memo off asks Redis every time; and a place freed at a
router (its queued request cancelled by its client) is taken by that router's next request."""

from __future__ import annotations

import asyncio
import hashlib

import grpc
import pytest

from services.proto.tokenrelay.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from tests.e2e.prockit import Procs, refusal_of, routers_on_redis
from tests.meshkit import metric_sum

KEY = "queue-key-" + "q" * 16
# One request runs at a time, two may wait.
TENANTS = ("tenants:\n  - name: tq\n    api_key_sha256: " + hashlib.sha256(KEY.encode()).hexdigest()
           + "\n    max_in_flight: 1\n    max_queued: 2\n")
METADATA = (("authorization", f"Bearer {KEY}"),)
ROUTERS = {"memo": [], "memo2": [], "asks": ["--queue-memo-ms", "0"]}
N = 20


def _call(stub: inference_pb2_grpc.InferenceStub, rid: str, max_tokens: int = 4, timeout: float = 2.0):
    return stub.Generate(inference_pb2.GenerateRequest(
        prompt="queue", request_id=rid, sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True)),
        metadata=METADATA, timeout=timeout)


async def _refusal(stub: inference_pb2_grpc.InferenceStub, rid: str) -> tuple[str, int]:
    """A request expected to be refused at once: its reason and retry-after (ms)."""
    call = _call(stub, rid)
    try:
        async for event in call:
            raise AssertionError(f"{rid} was not refused: {event}")
    except grpc.aio.AioRpcError as exc:
        assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
        return refusal_of(exc)
    raise AssertionError(f"{rid} ended without a status")


async def _held(stub: inference_pb2_grpc.InferenceStub, rid: str, max_tokens: int) -> tuple[object, object]:
    """A request left open after its first message (`accepted`: running or queued)."""
    call = _call(stub, rid, max_tokens=max_tokens, timeout=60)
    first = await call.read()
    assert first.HasField("accepted"), first
    return call, first.accepted


@pytest.fixture
async def mesh(tmp_path):
    async with routers_on_redis(tmp_path, TENANTS, ROUTERS) as p:
        yield p


async def test_a_full_queue_is_refused_by_each_router_without_a_round_trip_each(mesh) -> None:
    p: Procs = mesh
    stubs = p.stubs
    held = []
    try:
        run, accepted = await _held(stubs["memo"], "run", max_tokens=3000)       # ~30 s of decoding
        assert accepted.queue_position == 0
        held.append(run)
        q1, accepted = await _held(stubs["memo"], "q1", max_tokens=4)
        assert accepted.queue_position == 1
        held.append(q1)
        q2, accepted = await _held(stubs["memo2"], "q2", max_tokens=4)
        assert accepted.queue_position == 2
        held.append(q2)
        answers, elapsed, calls, local = await p.asked_by_each_router(_refusal, N, "tenant_queue_full")
        for name, got in answers.items():
            assert {reason for reason, _ in got} == {"TENANT_QUEUE_FULL"}, (name, got)
            assert all(100 <= retry <= 60_000 for _, retry in got), (name, got)
        # The memo off: one ENQUEUE per request. On: memo2 knew from queueing q2 as the last place,
        # memo from its first refusal; each asks again at most once per 250 ms window (the default).
        assert calls["asks"] >= N and local["asks"] == 0, (calls, local)
        for name in ("memo", "memo2"):
            assert calls[name] <= 1 + elapsed / 0.25 and calls[name] < N / 2, (name, calls, elapsed)
            assert local[name] >= N - calls[name], (name, local, calls)
        # q1's client goes away: its place is freed at its router, whose next request takes it.
        q1.cancel()
        held.remove(q1)
        async def withdrawn() -> None:
            while metric_sum(p.metrics["memo"], "tokenrelay_router_redis_seconds_count", op="cancel") < 1:
                await asyncio.sleep(0.01)
        await asyncio.wait_for(withdrawn(), 5)             # Redis has taken it out of the queue
        again, accepted = await _held(stubs["memo"], "again", max_tokens=4)
        held.append(again)
        assert accepted.queue_position == 2
    finally:
        for call in held:
            call.cancel()
