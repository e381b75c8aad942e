"""A tenant past its token budget, through real router processes sharing one Redis: once Redis has
refused it, each router refuses the tenant's next requests that cannot fit by itself
(`--budget-memo-ms`, router_svc/budget_memo.py), with the same reason and a retry-after, and
without an ENQUEUE round trip each; a router with the memo off asks Redis every time."""

from __future__ import annotations

import hashlib

import grpc
import pytest

from services.proto.tokenrelay.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from tests.e2e.prockit import Procs, refusal_of, routers_on_redis

KEY = "budget-key-" + "d" * 16
# 200 tokens a minute: one long request spends most of it; then each request (~20 tokens) needs ~6 s
# of refill, past its 2 s deadline.
TENANTS = ("tenants:\n  - name: tb\n    api_key_sha256: " + hashlib.sha256(KEY.encode()).hexdigest()
           + "\n    max_in_flight: 64\n    max_queued: 64\n    tokens_per_minute: 200\n")
METADATA = (("authorization", f"Bearer {KEY}"),)
ROUTERS = {"memo": [], "memo2": [], "asks": ["--budget-memo-ms", "0"]}
N = 30


async def _ask(stub: inference_pb2_grpc.InferenceStub, rid: str, max_tokens: int = 12,
               timeout: float = 2.0) -> tuple[str, int]:
    """One request: 'done', or the refusal's reason and retry-after (ms)."""
    call = stub.Generate(inference_pb2.GenerateRequest(
        prompt="budget", request_id=rid, sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True)),
        metadata=METADATA, timeout=timeout)
    try:
        async for _ in call:
            pass
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and timeout > 2.0:
            return "deadline", 0       # queued for its budget past its deadline (while spending it)
        assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
        return refusal_of(exc)
    return "done", 0


@pytest.fixture
async def mesh(tmp_path):
    async with routers_on_redis(tmp_path, TENANTS, ROUTERS) as p:
        yield p


async def test_a_tenant_past_its_budget_is_refused_by_each_router_without_a_round_trip_each(mesh) -> None:
    p: Procs = mesh
    stubs = p.stubs
    assert await _ask(stubs["memo"], "spend", max_tokens=150, timeout=10) == ("done", 0)
    spent: list[tuple[str, int]] = []
    while not spent or spent[-1][0] != "TOKEN_RATE_LIMITED":      # the rest of it
        assert len(spent) < 8, spent
        spent.append(await _ask(stubs["memo"], f"spend{len(spent)}", timeout=2.01))
    answers, elapsed, calls, local = await p.asked_by_each_router(_ask, N, "token_rate_limited")
    for name, got in answers.items():
        # Every one refused for its budget, with a retry-after past its 2 s deadline (the memo's is
        # the least the request can cost: a token of prompt and its max_tokens).
        assert {reason for reason, _ in got} == {"TOKEN_RATE_LIMITED"}, (name, got)
        assert all(2_000 < retry <= 60_000 for _, retry in got), (name, got)
    # The memo off: one ENQUEUE per request. On: Redis is asked again at most once per 500 ms
    # window (the default), so each router asks a few times, whichever router asked before.
    assert calls["asks"] >= N and local["asks"] == 0, (calls, local)
    for name in ("memo", "memo2"):
        assert calls[name] <= 2 + 2 * elapsed / 0.5 and calls[name] < N / 2, (name, calls, elapsed)
        assert local[name] >= N - calls[name], (name, local, calls)
