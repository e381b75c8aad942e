"""Placement: a pure policy over replica snapshots, and the in-process session affinity.

`LeastLoaded.choose`: a replica that is unhealthy, not serving (draining, backend stopped) or
excluded (already tried by this request) never gets new work. Among the rest, the session's
sticky replica wins (its prefix cache holds the conversation); otherwise the least outstanding
work: this router's in-flight plus the engine's queue, then its active count, then KV use.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from services.errors import Reason

from .ports import PlacementView, ReplicaSnapshot


def _eligible(s: ReplicaSnapshot, exclude: frozenset[str]) -> bool:
    return s.healthy and s.serving and s.address not in exclude


def _load(s: ReplicaSnapshot) -> tuple[float, int, float]:
    kv = s.kv_used / s.kv_total if s.kv_total else 0.0
    return (s.in_flight + s.queued, s.active, kv)


class LeastLoaded:
    """The default `ports.Placement`."""

    def choose(self, snapshots: Sequence[ReplicaSnapshot], request: PlacementView,
               exclude: frozenset[str] = frozenset()) -> str:
        candidates = [s for s in snapshots if _eligible(s, exclude)]
        if not candidates:
            raise Reason.NO_HEALTHY_REPLICA.error("no healthy, serving engine replica")
        if request.sticky:
            for s in candidates:
                if s.address == request.sticky:
                    return s.address
        return min(candidates, key=_load).address


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
