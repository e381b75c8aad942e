"""Placement: policies over replica snapshots, and the in-process session affinity.

Every policy sees the same eligible set: a replica that is unhealthy (its breaker open), not
serving (draining, backend stopped), excluded (already tried by this request) or outside the
request's pool never gets new work. The session's sticky replica wins unless it is saturated
(its batch full with requests waiting, or its KV cache above the high-water mark): the session
then moves, and the engine stage records the move.

Policies (`--routing-policy`):
- `least-loaded`: the least outstanding work — this router's in-flight plus the engine's queue,
  then its active count, then KV use.
- `round-robin`, `random`: baselines.
- `session`: sticky by session, else round-robin (no load or cache knowledge).
- `prefix` (`PrefixAware`): the replica that minimizes estimated work before the first token:
  the prompt tokens it would have to prefill (the prompt minus the longest cached prefix the
  `PrefixIndex` knows it holds), plus `load_cost` tokens per request the new one would wait behind
  (beyond the engine's batch) and `run_cost` per request running there (each shares every step) —
  and one more `load_cost` when its free KV blocks cannot hold the uncached prompt and the reply,
  and, on a replica whose cache the conversations there could outgrow, `evict_cost` tokens per token
  of other conversations in progress there (`live_pressure`: they grow where they are and compete
  with this one for its blocks), and `hold_cost` tokens per hold there (a conversation between
  turns: its next turn is expected within milliseconds; `PrefixIndex.held`), weighted down
  linearly to 0 over the hold's `hold_ttl` —
  never a cache hit at any price: a replica with more requests than the balance bound allows
  (`balance_rel` × the least loaded one's, or that plus `balance_abs`) is not a candidate.
  While router processes share their placements (`placement_share.PlacementShare`, live),
  `remote_in_flight` adds the other routers' requests in flight to this router's own and the
  engine's reported counts are clamped to that total (`cluster_view`), so every router weighs the
  same, current load.
"""

from __future__ import annotations

import itertools
import random
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from services.errors import Reason

from .ports import PlacementView, ReplicaSnapshot
from .prefix_index import PrefixIndex

KV_HIGH_WATER = 0.95


def eligible(snapshots: Sequence[ReplicaSnapshot], request: PlacementView,
             exclude: frozenset[str]) -> list[ReplicaSnapshot]:
    """The replicas that may get this request; raises NO_HEALTHY_REPLICA when there is none."""
    pool = request.pool
    candidates = [s for s in snapshots if s.healthy and s.serving and s.address not in exclude
                  and (not pool or s.pool == pool)]
    if not candidates:
        where = f" in pool {pool!r}" if pool else ""
        raise Reason.NO_HEALTHY_REPLICA.error(f"no healthy, serving engine replica{where}")
    return candidates


def outstanding(s: ReplicaSnapshot) -> int:
    """Requests waiting for or holding the replica: this router's in flight plus the engine's queue."""
    return s.in_flight + s.queued


def kv_fraction(s: ReplicaSnapshot) -> float:
    return s.kv_used / s.kv_total if s.kv_total else 0.0


def saturated(s: ReplicaSnapshot, kv_high: float = KV_HIGH_WATER) -> bool:
    """Its batch is full with requests waiting, or its KV cache is nearly full."""
    batch_full = s.max_active > 0 and s.active >= s.max_active and s.queued > 0
    return batch_full or kv_fraction(s) >= kv_high


def sticky_choice(candidates: Sequence[ReplicaSnapshot], request: PlacementView) -> str:
    """The session's replica if it is a candidate and not saturated, else ""."""
    if request.sticky:
        for s in candidates:
            if s.address == request.sticky:
                return "" if saturated(s) else s.address
    return ""


def _load(s: ReplicaSnapshot) -> tuple[float, int, float]:
    return (outstanding(s), s.active, kv_fraction(s))


class LeastLoaded:
    """The default `ports.Placement` until prefix-aware routing is chosen."""

    name = "least-loaded"

    def choose(self, snapshots: Sequence[ReplicaSnapshot], request: PlacementView,
               exclude: frozenset[str] = frozenset()) -> str:
        candidates = eligible(snapshots, request, exclude)
        return sticky_choice(candidates, request) or min(candidates, key=_load).address


class RoundRobin:
    """A baseline: the next eligible replica in address order (sticky sessions honoured)."""

    name = "round-robin"

    def __init__(self, honour_sessions: bool = False) -> None:
        self._counter = itertools.count()
        self._sessions = honour_sessions

    def choose(self, snapshots: Sequence[ReplicaSnapshot], request: PlacementView,
               exclude: frozenset[str] = frozenset()) -> str:
        candidates = sorted(eligible(snapshots, request, exclude), key=lambda s: s.address)
        if self._sessions:
            held = sticky_choice(candidates, request)
            if held:
                return held
        return candidates[next(self._counter) % len(candidates)].address


class SessionOnly(RoundRobin):
    """A baseline: sticky by session, else round-robin; no load or cache knowledge."""

    name = "session"

    def __init__(self) -> None:
        super().__init__(honour_sessions=True)


class Random:
    """A baseline: a uniformly random eligible replica."""

    name = "random"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(self, snapshots: Sequence[ReplicaSnapshot], request: PlacementView,
               exclude: frozenset[str] = frozenset()) -> str:
        return self._rng.choice(eligible(snapshots, request, exclude)).address


@dataclass
class PrefixWeights:
    load_cost: float = 256.0     # prompt tokens of prefill one request waiting ahead (batch full) is worth
    run_cost: float = 16.0       # ... and one request running there (it shares every step)
    balance_rel: float = 1.25    # a candidate's requests ≤ max(rel × least, least + abs)
    balance_abs: int = 1
    kv_high: float = KV_HIGH_WATER
    evict_cost: float = 0.0      # ... per token of other conversations in progress (`live_pressure`; 0 = off)
    hold_cost: float = 512.0     # ... per fresh hold of another conversation between turns (0 = off)


def requests_on(s: ReplicaSnapshot) -> int:
    """Requests on the replica as best known: the engine's running + queued (every router's), or the
    routers' in flight when that is more (the engine's report lags): this router's own, plus the
    others' where placements are shared (`PrefixAware.remote_in_flight`)."""
    return max(s.active + s.queued, s.in_flight)


def waiting_ahead(s: ReplicaSnapshot) -> int:
    """Requests a new one would wait behind: beyond the engine's batch (unknown batch: none)."""
    if not s.max_active:
        return s.queued
    return max(s.queued, requests_on(s) + 1 - s.max_active, 0)


GROWTH = 4   # live_pressure: conversations in progress may grow to this many times what they hold


def live_pressure(s: ReplicaSnapshot, resident: int, need: int, live: int, live_matched: int) -> int:
    """Blocks of other conversations in progress on `s` (`live` live blocks there, `live_matched` of
    them this prompt's own cached prefix), where its cache could run out: what it holds (`resident`
    blocks, or `kv_used` if more) plus the `need` more blocks of this request, grown `GROWTH` times,
    exceed its KV blocks; else 0. Conversations grow where they are and compete with this one for
    the replica's blocks, so a conversation is better placed beside small ones (or stale blocks:
    conversations that ended) than beside large ones it will evict, or be evicted by, later."""
    if not s.kv_total or (max(resident, s.kv_used) + need) * GROWTH <= s.kv_total:
        return 0
    return max(0, live - live_matched)


def cluster_view(s: ReplicaSnapshot, remote: int) -> ReplicaSnapshot:
    """The replica as every router sees it when all share their in-flight counts: the routers'
    requests there (this one's + the others'), and the engine's running / queued counts clamped to
    that total — the engine's report is the last one that reached this router (on its own stream or
    the poll, up to a poll interval old) and overstates a replica whose requests just ended; the
    shared counts are milliseconds old."""
    total = s.in_flight + remote
    active = min(s.active, total)
    queued = min(s.queued, total - active)
    if (total, active, queued) == (s.in_flight, s.active, s.queued):
        return s
    return replace(s, in_flight=total, active=active, queued=queued)


class PrefixAware:
    """Prefix-cache-aware placement weighed against load (module doc). `index` is read only here;
    the engine stage records placements in it and the KV-event subscribers keep it current."""

    name = "prefix"

    def __init__(self, index: PrefixIndex, weights: PrefixWeights | None = None,
                 remote_in_flight: Callable[[], Mapping[str, int] | None] | None = None) -> None:
        self.index = index
        self.w = weights or PrefixWeights()
        # The other routers' requests per replica while placements are shared (None: not live now).
        self.remote_in_flight = remote_in_flight

    def choose(self, snapshots: Sequence[ReplicaSnapshot], request: PlacementView,
               exclude: frozenset[str] = frozenset()) -> str:
        candidates = eligible(snapshots, request, exclude)
        if self.remote_in_flight is not None:
            remote = self.remote_in_flight()
            if remote is not None:
                candidates = [cluster_view(s, remote.get(s.address, 0)) for s in candidates]
        held = sticky_choice(candidates, request)
        if held:
            return held
        w = self.w
        prompt_len = request.prompt_tokens or len(request.prompt_ids)
        tpb = self.index.tokens_per_block
        live: dict[str, tuple[int, int, int]] | None = {} if w.evict_cost > 0 else None
        depths = self.index.match(request.prompt_ids, [s.address for s in candidates], request.cache_salt, live)

        def cached(s: ReplicaSnapshot) -> int:
            return min(depths.get(s.address, 0) * tpb, max(0, prompt_len - 1))

        def kv_short(s: ReplicaSnapshot) -> int:
            """1 if its free KV blocks cannot hold what the request still needs (it would wait for a
            running request to end), else 0."""
            if not s.kv_total:
                return 0
            need = -(-(prompt_len - cached(s) + request.max_tokens) // max(1, s.tokens_per_block or tpb))
            return int(s.kv_total - s.kv_used < need)

        least = min(requests_on(s) for s in candidates)
        bound = max(least * w.balance_rel, least + w.balance_abs)
        balanced = [s for s in candidates if requests_on(s) <= bound]

        def evict(s: ReplicaSnapshot) -> float:
            """Tokens of other conversations in progress there, where they could outgrow its cache."""
            seen = live.get(s.address) if live is not None else None
            if seen is None:
                return 0.0
            bs = max(1, s.tokens_per_block or tpb)
            resident, n_live, n_matched = seen
            need = -(-(prompt_len + request.max_tokens) // bs) - depths.get(s.address, 0)
            return live_pressure(s, resident, need, n_live, n_matched) * bs * w.evict_cost

        holds = self.index.held(request.prompt_ids, request.cache_salt, [s.address for s in balanced]) \
            if w.hold_cost > 0 else {}

        def hold_weight(s: ReplicaSnapshot) -> float:
            """Fresh holds of other conversations there: a new one would take their turn's slot."""
            return w.hold_cost * holds.get(s.address, 0.0)

        def cost(s: ReplicaSnapshot) -> tuple[float, int]:
            on = requests_on(s)
            waits = waiting_ahead(s) + kv_short(s)
            return (prompt_len - cached(s) + w.load_cost * waits + w.run_cost * on + evict(s) + hold_weight(s), on)

        return min(balanced, key=cost).address     # ties: the first in the pool's order, on every router


POLICIES = ("least-loaded", "round-robin", "random", "session", "prefix")


def make_policy(name: str, index: PrefixIndex | None = None, weights: PrefixWeights | None = None,
                seed: int | None = None) -> LeastLoaded | RoundRobin | Random | PrefixAware:
    if name == "least-loaded":
        return LeastLoaded()
    if name == "round-robin":
        return RoundRobin()
    if name == "session":
        return SessionOnly()
    if name == "random":
        return Random(seed)
    if name == "prefix":
        return PrefixAware(index if index is not None else PrefixIndex(), weights)
    raise ValueError(f"unknown routing policy {name!r} (one of: {', '.join(POLICIES)})")


class LocalSessionAffinity:
    """`ports.SessionAffinity` in one process: an LRU of (tenant, session) → replica address."""

    def __init__(self, capacity: int = 100_000) -> None:
        self._map: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._capacity = capacity

    def __len__(self) -> int:
        return len(self._map)

    async def get(self, tenant: str, session_id: str) -> str:
        key = (tenant, session_id)
        address = self._map.get(key, "")
        if address:
            self._map.move_to_end(key)
        return address

    async def set(self, tenant: str, session_id: str, address: str) -> None:
        key = (tenant, session_id)
        self._map[key] = address
        self._map.move_to_end(key)
        while len(self._map) > self._capacity:
            self._map.popitem(last=False)
