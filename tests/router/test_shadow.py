"""Shadow traffic (router_svc/shadow.py) against scripted engines: what is mirrored, what is
recorded, and that a shadow never touches its primary (the real-process test is
tests/e2e/test_pools_mesh.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

from prometheus_client import REGISTRY

from router_svc.pipeline import Ports, Router, RouterOptions
from router_svc.placement import LeastLoaded
from router_svc.pools import SplitConfig, SplitSelector, TrafficSplit
from router_svc.ports import ReplicaSnapshot
from router_svc.request import RequestState
from router_svc.shadow import ShadowMirror, divergence, sampled
from router_svc.types import Delta, Done, GenerateInput, Sampling
from tests.router.core_fakes import (
    TENANT,
    FakeAdmission,
    FakeDetokenize,
    FakeEngines,
    FakeReplica,
    FakeTokenizer,
)
from tests.waiting import poll


class PoolEngines(FakeEngines):
    """FakeEngines whose replicas belong to pools ("pool/address" → pool); a replica with "answer"
    as its behaviour answers `answers[address]`."""

    def __init__(self, *replicas: FakeReplica) -> None:
        super().__init__(*replicas)
        self.answers: dict[str, list[int]] = {}

    def snapshots(self) -> Sequence[ReplicaSnapshot]:
        return [ReplicaSnapshot(r.address, r.healthy, r.serving, r.in_flight, pool=r.address.split("/")[0])
                for r in self.replicas.values()]

    def submit(self, address: str, request_id: str, *args: Any, **kw: Any) -> Any:
        source = super().submit(address, request_id, *args, **kw)
        if self.replicas[address].behaviour == ["answer"]:
            source.tokens(*self.answers[address], finished=True)
        return source


def _state(request_id: str = "r1", tokens: Sequence[int] = (), pool: str = "default",
           temperature: float = 0.0) -> RequestState:
    state = RequestState("t", request_id, GenerateInput(Sampling(max_tokens=3, temperature=temperature), prompt="x"),
                         2, time.monotonic() + 30, time.monotonic(), prompt_ids=[5, 6, 7])
    state.pool, state.replica = pool, "default/a"
    state.generated.extend(tokens)
    return state


def _mirror(engines: PoolEngines, pool: str = "shadow", fraction: float = 1.0, **kw: Any) -> ShadowMirror:
    config = SplitConfig.build("default=100", pool, fraction)
    return ShadowMirror(engines, LeastLoaded(), lambda: config, lambda: [2], **kw)


def _metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def _finish(state: RequestState, mirror: ShadowMirror) -> None:
    state.engine_done = True
    mirror.finished(state)


def test_divergence_and_sampling():
    assert divergence([1, 2, 3], [1, 2, 3]) == (d := divergence([1, 2, 3], [1, 2, 3])) and d.exact
    d = divergence([1, 2, 3, 4], [1, 9, 3, 4])
    assert (d.first_diff, d.match_ratio) == (1, 0.75)
    d = divergence([1, 2], [1, 2, 3, 4])                       # a prefix: differs where one ends
    assert (d.first_diff, d.match_ratio) == (2, 0.5)
    assert divergence([], []).exact
    share = sum(sampled(0.05, "t", f"r{i}") for i in range(4000)) / 4000
    assert 0.035 <= share <= 0.065
    assert [sampled(0.3, "t", f"r{i}") for i in range(50)] == [sampled(0.3, "t", f"r{i}") for i in range(50)]
    assert not any(sampled(0.0, "t", f"r{i}") for i in range(50)) and all(sampled(1.0, "t", f"r{i}")
                                                                         for i in range(50))


async def test_an_identical_answer_is_a_match_and_a_different_one_is_measured():
    engines = PoolEngines(FakeReplica("default/a"), FakeReplica("shadow/b", ["manual"]))
    mirror = _mirror(engines)
    match0 = _metric("tokenrelay_router_shadow_requests_total", pool="shadow", result="match")
    diverged0 = _metric("tokenrelay_router_shadow_requests_total", pool="shadow", result="diverged")
    same, other = _state("same", [101, 102, 103]), _state("other", [101, 102, 103])
    for state in (same, other):
        mirror.started(state)
    shadow = engines.replicas["shadow/b"]
    assert shadow.submitted == [f"shadow-{same.upstream_id}", f"shadow-{other.upstream_id}"]
    assert [p for _, p in shadow.pushed_down] == [1, 1]          # low priority, within the primary's deadline
    assert all(0 < t <= 30 for t, _ in shadow.pushed_down)
    shadow.sources[f"shadow-{same.upstream_id}"].tokens(101, 102)
    shadow.sources[f"shadow-{same.upstream_id}"].tokens(103, finished=True)
    shadow.sources[f"shadow-{other.upstream_id}"].tokens(101, 7, 103, finished=True)
    _finish(same, mirror)
    _finish(other, mirror)
    await poll(lambda: mirror.in_flight == 0, what="both shadows recorded")
    assert _metric("tokenrelay_router_shadow_requests_total", pool="shadow", result="match") == match0 + 1
    assert _metric("tokenrelay_router_shadow_requests_total", pool="shadow", result="diverged") == diverged0 + 1
    assert same.generated == [101, 102, 103] and other.generated == [101, 102, 103]   # the primaries untouched
    assert shadow.released == shadow.submitted and shadow.aborted == []


async def test_a_cancelled_primary_aborts_its_shadow_and_a_failing_shadow_is_only_counted():
    engines = PoolEngines(FakeReplica("default/a"), FakeReplica("shadow/b", ["manual"]))
    mirror = _mirror(engines)
    state = _state("c")
    mirror.started(state)
    state.cancel()
    mirror.finished(state)
    await poll(lambda: mirror.in_flight == 0, what="the shadow to end")
    shadow = engines.replicas["shadow/b"]
    assert shadow.aborted == [f"shadow-{state.upstream_id}"] and shadow.released == shadow.aborted

    errors0 = _metric("tokenrelay_router_shadow_requests_total", pool="shadow", result="error")
    broken = _state("b", [101])
    mirror.started(broken)
    shadow.sources[f"shadow-{broken.upstream_id}"].broken()
    _finish(broken, mirror)
    await poll(lambda: mirror.in_flight == 0, what="the broken shadow to be recorded")
    assert _metric("tokenrelay_router_shadow_requests_total", pool="shadow", result="error") == errors0 + 1
    assert engines.failed == []            # a shadow's failure never marks a replica for the primaries


async def test_bounds_no_replica_same_pool_and_fraction():
    engines = PoolEngines(FakeReplica("default/a"), FakeReplica("shadow/b", ["manual"]))
    mirror = _mirror(engines, max_in_flight=2)
    dropped0 = _metric("tokenrelay_router_shadow_requests_total", pool="shadow", result="dropped")
    states = [_state(f"r{i}") for i in range(5)]
    for state in states:
        mirror.started(state)
    assert mirror.in_flight == 2
    assert _metric("tokenrelay_router_shadow_requests_total", pool="shadow", result="dropped") == dropped0 + 3
    on_shadow = _state("own", pool="shadow")     # its primary runs on the shadow pool already
    mirror.started(on_shadow)
    assert len(engines.replicas["shadow/b"].submitted) == 2
    for state in states:
        state.cancel()
        mirror.finished(state)
    await poll(lambda: mirror.in_flight == 0, what="the shadows to end")

    none0 = _metric("tokenrelay_router_shadow_requests_total", pool="nowhere", result="no_replica")
    lonely = _mirror(engines, pool="nowhere")
    lonely.started(_state("n"))
    assert _metric("tokenrelay_router_shadow_requests_total", pool="nowhere", result="no_replica") == none0 + 1

    some = _mirror(PoolEngines(FakeReplica("default/a"), FakeReplica("shadow/b", ["manual"])), fraction=0.25,
                   max_in_flight=1000)
    tried = [_state(f"s{i}") for i in range(400)]
    for state in tried:
        some.started(state)
    assert 60 <= some.in_flight <= 140 and some.in_flight == sum(sampled(0.25, "t", f"s{i}") for i in range(400))
    await some.close()
    await asyncio.sleep(0)



async def test_through_the_router_the_client_gets_the_primary_answer_only():
    # The request core with the split and the mirror wired as app.py wires them: the shadow pool
    # answers other tokens, which must never reach the client's stream.
    engines = PoolEngines(FakeReplica("default/a"), FakeReplica("shadow/b", ["answer"]))
    engines.answers = {"shadow/b": [7, 8, 9]}
    config = SplitConfig.build("default=100", "shadow", 1.0)
    split = TrafficSplit(config)
    mirror = ShadowMirror(engines, LeastLoaded(), lambda: config, lambda: [2])
    ports = Ports(FakeTokenizer(), FakeDetokenize(), engines, FakeAdmission(),
                  pools=SplitSelector(lambda: split, engines.snapshots), shadow=mirror)
    router = Router(ports, RouterOptions())
    diverged0 = _metric("tokenrelay_router_shadow_requests_total", pool="shadow", result="diverged")
    events = [e async for e in router.generate(TENANT, GenerateInput(Sampling(max_tokens=3), prompt="hi",
                                                                     return_token_ids=True))]
    deltas = [e for e in events if isinstance(e, Delta)]
    assert "".join(d.text for d in deltas) == "<101><102><103>"
    assert [t for d in deltas for t in d.token_ids] == [101, 102, 103]
    assert isinstance(events[-1], Done) and events[-1].usage.completion_tokens == 3
    assert len(engines.replicas["shadow/b"].submitted) == 1 and engines.replicas["default/a"].submitted
    await poll(lambda: _metric("tokenrelay_router_shadow_requests_total", pool="shadow",
                               result="diverged") == diverged0 + 1, what="the shadow's record")
