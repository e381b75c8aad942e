"""The mesh target against a fake Inference server on loopback (real gRPC, no mesh needed).

The fake counts one prompt token per 3 characters (+1 for BOS, +4 per chat message), so the
bench's calibration, API-key mapping, chat prefixes and measurements can be checked exactly.
"""

from __future__ import annotations

import itertools

import pytest

from tests.bench.benchkit import Seen, workload
from tokenrelay_tools.bench.runner import RunConfig, Runner
from tokenrelay_tools.bench.targets import MeshTarget

CHAT = {"name": "chat", "kind": "chat", "turns": 3, "system_tokens": 40, "prompt_tokens": 60, "output_tokens": 9}
WORKLOAD = workload(
    arrival={"mode": "closed", "concurrency": 3},
    tenants=[{"name": "a", "priorities": {"high": 1}}, {"name": "b", "priorities": {"low": 1}}],
    classes=[CHAT,
             {"name": "single", "prompt_tokens": {"dist": "uniform", "min": 100, "max": 300}, "output_tokens": 5}])


async def test_calibration_measures_the_servers_chars_per_token(fake_mesh) -> None:
    address, _ = fake_mesh
    target = MeshTarget(address, {}, "key-a")
    await target.start()
    try:
        assert target.chars_per_token == pytest.approx(3.0, rel=0.02)
    finally:
        await target.close()


async def test_mesh_runs_map_tenants_to_keys_and_chats_extend_the_conversation(fake_mesh) -> None:
    address, servicer = fake_mesh
    target = MeshTarget(address, {"a": "key-a"}, "key-b", chars_per_token=3.0)
    await target.start()
    try:
        result = await Runner(target, WORKLOAD, RunConfig(duration=None, requests=30)).run()
    finally:
        await target.close()
    assert len(result.records) == 30 and all(r.ok for r in result.records)
    assert [(s.tenant, s.priority) for s in servicer.seen] and \
        all((s.tenant, s.priority) in {("a", "high"), ("b", "low")} for s in servicer.seen)
    assert {r.tenant for r in result.records} == {s.tenant for s in servicer.seen}
    assert all(s.return_token_ids and s.ignore_eos for s in servicer.seen)
    for r in result.records:
        assert r.queue == pytest.approx(0.003) and r.completion_tokens == r.planned_output_tokens
        # One ITL sample per token after the first delta (which carries 2 tokens here).
        assert len(r.itl) == r.completion_tokens - r.deltas[0][1] and not r.itl_estimated
        if r.cls == "single":  # sized from the calibration: the plan + the 15-char nonce (5 tokens) + BOS
            assert abs(r.prompt_tokens - 1 - 5 - r.planned_prompt_tokens) <= 1
    chats: dict[str, list[Seen]] = {}
    for s in servicer.seen:
        if s.messages:
            chats.setdefault(s.session_id, []).append(s)
    assert chats and all(sid for sid in chats)
    for turns in chats.values():
        for prev, cur in itertools.pairwise(turns):
            # Each turn resends the previous conversation, then the reply, then a new user message.
            assert cur.messages[:len(prev.messages)] == prev.messages
            assert [role for role, _ in cur.messages[len(prev.messages):]] == ["assistant", "user"]
        assert turns[0].messages[0][0] == "system"
    # Unique prompts: a per-session nonce opens the (unshared) system prompt.
    firsts = [turns[0].messages[0][1][:14] for turns in chats.values()]
    assert len(set(firsts)) == len(firsts) and all(f.startswith("[") and f.endswith("]") for f in firsts)


async def test_the_chat_api_mode_estimates_itl_from_deltas_without_ids(fake_mesh) -> None:
    address, servicer = fake_mesh
    target = MeshTarget(address, {}, "key-a", chat_api="chat", chars_per_token=3.0)
    await target.start()
    try:
        w = workload(arrival={"mode": "closed", "concurrency": 2}, classes=[CHAT])
        result = await Runner(target, w, RunConfig(duration=None, requests=6)).run()
    finally:
        await target.close()
    assert len(result.records) == 6 and all(r.ok and r.itl_estimated for r in result.records)
    assert all(len(s.messages) in (2, 4, 6) for s in servicer.seen)  # system + user, then + reply + user


async def test_an_unknown_key_is_reported_per_request_by_status_and_reason(fake_mesh) -> None:
    address, _ = fake_mesh
    target = MeshTarget(address, {}, "wrong-key", chars_per_token=3.0)
    await target.start()
    try:
        result = await Runner(target, WORKLOAD, RunConfig(duration=None, requests=4)).run()
    finally:
        await target.close()
    assert [(r.status, r.reason) for r in result.records] == [("UNAUTHENTICATED", "UNKNOWN_API_KEY")] * 4
