"""Thin adapters from the concrete upstreams / admission to the core's ports (`ports.py`).

`app.py` wires these; tests wire fakes instead. Nothing here decides anything: the engine pool
is exposed as snapshots + address-keyed calls and the detokenizer session gains `next_ready()`
(the admission queue implements its port itself).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from services.logging import get_logger

from .ports import Broken, ChunkSource, DetokSessionPort, ReplicaSnapshot
from .types import DetokOut, Sampling

log = get_logger(__name__)


# ---------------------------------------------------------------------------------------- engines
class EnginesAdapter:
    """`ports.EngineStream` over `upstreams.EnginePool` (whose membership changes at runtime: every
    call goes to the pool, which knows the replicas of now)."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool

    def snapshots(self) -> Sequence[ReplicaSnapshot]:
        return self.pool.snapshots()  # type: ignore[no-any-return]

    @property
    def max_context(self) -> int:
        return int(self.pool.max_context)

    def submit(self, address: str, request_id: str, prompt: list[int], sampling: Sampling,
               eos_ids: list[int], cache_salt: str, trace_context: dict[str, str], *,
               timeout: float = 0.0, priority: int = 0) -> ChunkSource:
        return self.pool.submit(address, request_id, prompt, sampling, eos_ids,  # type: ignore[no-any-return]
                                cache_salt, trace_context, timeout=timeout, priority=priority)

    def abort(self, address: str, request_id: str) -> None:
        self.pool.abort(address, request_id)

    def release(self, address: str, request_id: str) -> None:
        self.pool.release(address, request_id)

    def mark_failed(self, address: str) -> None:
        self.pool.mark_failed(address)

    def heard(self, address: str) -> float:
        return self.pool.heard(address)  # type: ignore[no-any-return]


# ------------------------------------------------------------------------------------ detokenizer
class _DetokSession:
    """Adds `next_ready()` to an upstream `DetokSession` (whose `.queue` holds its outputs)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.start = inner.start
        self.send = inner.send
        self.fail = inner.fail
        self.close = inner.close

    async def next_ready(self) -> list[DetokOut | Broken]:
        queue: asyncio.Queue[Any] = self._inner.queue
        items = [await queue.get()]
        while not queue.empty():
            items.append(queue.get_nowait())
        return items


class DetokenizeAdapter:
    """`ports.Detokenize` over `upstreams.TokenizerUpstream` (uses its own `next_ready` if it has one)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def detokenizer(self, request_id: str) -> DetokSessionPort:
        session = self.tokenizer.detokenizer(request_id)
        if hasattr(session, "next_ready"):
            return session  # type: ignore[no-any-return]
        return _DetokSession(session)


# --------------------------------------------------------------------------------------- overload
class _NoTicket:
    def exit(self) -> None:
        return None


class NoGate:
    """The `ports.LoadGate` used when none is wired: admits everything."""

    _ticket = _NoTicket()

    def enter(self) -> _NoTicket:
        return self._ticket


def build_router(tokenizer: Any, engines: Any, admission: Any, *, request_timeout: float = 600.0,
                 engine_attempts: int = 2, progress_timeout: float = 10.0, bounds: Any = None,
                 registry: Any = None, affinity: Any = None, gate: Any = None, placement: Any = None,
                 default_max_queued: int = 256, engine_migrations: int = 2, pools: Any = None,
                 shadow: Any = None, admit_while_tokenizing: bool = True, detokenize: Any = None,
                 chat_prefetch_max_in_flight: int = 32) -> Any:
    """A `pipeline.Router` over the concrete upstreams (`TokenizerUpstream`, `EnginePool`) and the
    admission queue (`admission.Admission`, a `ports.Admission` itself); registry / affinity /
    gate / placement default to the in-process ones; `detokenize` (a `ports.Detokenize`, e.g.
    `local_detok.LocalDetokenize`) defaults to the tokenizer's Detokenize stream. `app.py` and the
    tests wire through this."""
    from .pipeline import Ports, Router, RouterOptions
    from .placement import LeastLoaded, LocalSessionAffinity
    from .request import LocalRequestRegistry
    from .validation import DEFAULT_BOUNDS

    engine_port = EnginesAdapter(engines)
    if hasattr(admission, "use_engines"):     # the admission queue dispatches only while the engines have room
        # ...of the pools that get traffic: a shadow-only pool's replicas are no room for primary work
        admission.use_engines(getattr(pools, "routed_snapshots", engine_port.snapshots))
    ports = Ports(tokenizer, detokenize or DetokenizeAdapter(tokenizer), engine_port, admission,
                  placement or LeastLoaded(), affinity or LocalSessionAffinity(),
                  registry or LocalRequestRegistry(), gate or NoGate(), pools, shadow)
    return Router(ports, RouterOptions(request_timeout, engine_attempts, progress_timeout, bounds or DEFAULT_BOUNDS,
                                       default_max_queued, engine_migrations, admit_while_tokenizing,
                                       chat_prefetch_max_in_flight))
