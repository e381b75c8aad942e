"""Observability end to end: one trace across all three services, and /metrics counting traffic.

The mesh runs as real processes started by `tokenrelay up`; spans reach the test through the JSONL
exporter every process appends to (TOKENRELAY_TRACE_FILE), metrics through each /metrics port.
"""

from __future__ import annotations

import asyncio
import json
import os

import pytest

from services.client import Client
from tests.meshkit import scrape, start_mesh, stop_mesh


@pytest.fixture(scope="module")
def traced_mesh(tmp_path_factory, model_dir):
    tmp = tmp_path_factory.mktemp("traced")
    trace_file = tmp / "spans.jsonl"
    os.environ["TOKENRELAY_TRACE_FILE"] = str(trace_file)
    try:
        # The tokenizer service in every request's path (up's routers would (de)tokenize these short
        # prompts themselves), so that one trace crosses all three services.
        mesh = start_mesh(tmp, model_dir, "sim", "--engine-arg=--sim-decode-step-time=0.002",
                          "--router-arg=--detokenize=tokenizer", "--router-arg=--tokenize-local-bytes=0")
    finally:
        del os.environ["TOKENRELAY_TRACE_FILE"]
    yield mesh, trace_file
    assert stop_mesh(mesh) == 0


def _root(trace_file, request_id: str) -> dict | None:
    spans = [json.loads(line) for line in trace_file.read_text().splitlines()]
    return next((s for s in spans if s["name"] == "tokenrelay.generate"
                 and s["attributes"].get("tokenrelay.request_id") == request_id), None)


def _spans(trace_file, trace_id: str) -> list[dict]:
    spans = [json.loads(line) for line in trace_file.read_text().splitlines()]
    return [s for s in spans if s["trace_id"] == trace_id]


async def test_one_trace_across_all_services(traced_mesh):
    mesh, trace_file = traced_mesh
    async with Client(mesh.address, mesh.api_key) as client:
        result = await client.generate("Once upon a time", max_tokens=12, ignore_eos=True)
    assert result.finished.completion_tokens == 12
    # The root span ends just after the client has its `done`: wait for it to be exported.
    deadline = asyncio.get_running_loop().time() + 10
    while (root := _root(trace_file, result.request_id)) is None:
        assert asyncio.get_running_loop().time() < deadline, "root span never exported"
        await asyncio.sleep(0.02)
    spans = _spans(trace_file, root["trace_id"])
    by_name = {s["name"]: s for s in spans}
    assert {s["service"] for s in spans} == {"router_svc", "tokenizer_svc", "engine_svc"}
    for stage in ("tokenize", "queue_wait", "route", "prefill", "decode"):
        assert by_name[stage]["parent_id"] == root["span_id"], stage
    # the services' own spans hang under the router stage that caused them
    assert by_name["tokenizer.tokenize"]["parent_id"] == by_name["tokenize"]["span_id"]
    assert by_name["engine.generate"]["parent_id"] == by_name["prefill"]["span_id"]
    assert by_name["tokenizer.detokenize"]["parent_id"] == root["span_id"]
    assert by_name["engine.generate"]["attributes"]["tokenrelay.completion_tokens"] == 12
    # stages are ordered in time and nested inside the root
    assert by_name["tokenize"]["end"] <= by_name["queue_wait"]["start"]
    assert by_name["prefill"]["end"] <= by_name["decode"]["start"]
    for span in spans:
        assert root["start"] <= span["start"] <= span["end"] <= root["end"] + 50_000_000, span["name"]


async def test_metrics_count_the_traffic(traced_mesh):
    mesh, _ = traced_mesh
    urls = mesh.state["metrics"]
    label = {"tenant": "dev", "priority": "normal"}  # the tenant's default class
    before = scrape(urls["router"])
    n = 5
    async with Client(mesh.address, mesh.api_key) as client:
        for _ in range(n):
            await client.generate("Once upon a time", max_tokens=6, ignore_eos=True)
    after = scrape(urls["router"])

    def delta(name: str, **labels: str) -> float:
        key = (name, frozenset(labels.items()))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("tokenrelay_router_ttft_seconds_count", **label) == n
    assert delta("tokenrelay_router_e2e_seconds_count", **label) == n
    assert delta("tokenrelay_router_queue_seconds_count", **label) == n
    assert delta("tokenrelay_router_requests_total", **label, outcome="ok", reason="LENGTH") == n
    assert delta("tokenrelay_router_tokens_total", tenant="dev", kind="completion") == 6 * n
    assert delta("tokenrelay_router_inter_token_seconds_count", **label) >= 1
    engine = scrape(urls["engine"])
    assert engine[("tokenrelay_engine_generated_tokens_total", frozenset())] >= 6 * n
    tokenizer = scrape(urls["tokenizer"])
    assert any(name.startswith("tokenrelay_tokenizer_") for name, _ in tokenizer)


async def test_idle_spin_runs_from_a_request_to_its_window_after_and_is_counted(tmp_path, model_dir):
    """A router with --idle-spin-ms (real processes, `tokenrelay up`): nothing spun before any request;
    a request's life plus the window after it is counted on /metrics; then the loop sleeps again."""
    mesh = start_mesh(tmp_path, model_dir, "sim", "--router-arg=--idle-spin-ms=300")
    try:
        url = mesh.state["metrics"]["router"]          # type: ignore[index]
        name = "tokenrelay_router_idle_spin_seconds_total"
        assert scrape(url)[(name, frozenset())] == 0.0
        async with Client(mesh.address, mesh.api_key) as client:
            result = await client.generate("Once upon a time", max_tokens=8, ignore_eos=True)
        assert result.finished.completion_tokens == 8
        deadline = asyncio.get_running_loop().time() + 10
        while (spun := scrape(url)[(name, frozenset())]) == 0.0:   # counted when the spin stops
            assert asyncio.get_running_loop().time() < deadline, "the spin never stopped"
            await asyncio.sleep(0.1)
        assert 0.3 <= spun < 5.0
        await asyncio.sleep(0.6)
        assert scrape(url)[(name, frozenset())] == spun             # asleep since: nothing more counted
    finally:
        assert stop_mesh(mesh) == 0
