"""Ports of the request core: what the pipeline needs from the outside, as Protocols.

The pipeline (`pipeline.py`, `engine_stage.py`) imports only these and `request.py`; the gRPC
adapters (`upstreams.py`, `adapters.py`), Redis (`admission.py`, `cluster.py`) and the overload
gate (`overload.py`) implement them, and `app.py` wires them. Keep these signatures stable:
other modules implement them in parallel.

Conventions
- Every method that can fail raises a typed `TokenrelayError` (`Reason.X.error(...)`), never a
  transport exception.
- Ids: `tenant` is the tenant's name; `request_id` is the client's id (or a generated one). A
  request id is only ever meaningful together with its tenant (`RequestRegistry`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from .request import RequestState
from .types import DetokOut, EngineChunk, Sampling, TokenizerMeta, Usage


# ------------------------------------------------------------------------------------------ tokenizer
class Tokenize(Protocol):
    """Text or chat messages → prompt token ids (the tokenizer service)."""

    meta: TokenizerMeta | None

    async def tokenize(self, *, text: str | None = None, messages: list[tuple[str, str]] | None = None,
                       timeout: float | None = None, cache_key: str = "",
                       allow_special_tokens: bool = False) -> list[int]: ...


class Broken(Protocol):
    """A marker an output source yields when its transport broke (`services.mux.StreamBroken`)."""

    error: Exception


class DetokSessionPort(Protocol):
    """One request's incremental detokenization.

    `start` once, then `send` engine tokens as they come (`final=True` with the last); outputs
    come back through `next_ready()`, which returns EVERY output ready now and waits only when
    none is (so the delta loop merges them into one client message per write). A transport
    failure arrives as a `Broken` item; `fail(error)` injects one (the engine side failed).
    `close(flushed)` ends it (tells the tokenizer to drop its state unless it already finished).
    """

    def start(self, stop: list[str], include_stop: bool, prefix_ids: list[int],
              trace_context: dict[str, str]) -> None: ...

    def send(self, token_ids: list[int], final: bool) -> None: ...

    async def next_ready(self) -> list[DetokOut | Broken]: ...

    def fail(self, error: Exception) -> None: ...

    def close(self, flushed: bool) -> None: ...


class Detokenize(Protocol):
    def detokenizer(self, request_id: str) -> DetokSessionPort: ...


# --------------------------------------------------------------------------------------------- engine
@dataclass(frozen=True)
class ReplicaSnapshot:
    """What placement knows of one engine replica at one instant (plain data, no transport).

    `in_flight`: this router's open requests on it; `queued`/`active`/`max_active`/`kv_*`: the
    engine's last reported load (on its stream, or the poll). `serving` is False while the engine
    drains or its backend is stopped: such a replica gets no new work.
    """

    address: str
    healthy: bool = True
    serving: bool = True
    in_flight: int = 0
    queued: int = 0
    active: int = 0
    max_active: int = 0
    kv_used: int = 0
    kv_total: int = 0
    pool: str = "default"      # the engine pool (traffic split) it belongs to
    tokens_per_block: int = 0  # its KV block size (0 = unknown)


@dataclass(frozen=True)
class PlacementView:
    """What placement may know of a request."""

    tenant: str
    session_id: str = ""
    prompt_tokens: int = 0
    sticky: str = ""           # the session's replica (from SessionAffinity), "" if none
    pool: str = ""             # only replicas of this pool ("" = any)
    prompt_ids: Sequence[int] = ()   # the prompt (prefix-aware policies hash its blocks)
    cache_salt: str = ""
    max_tokens: int = 0        # its token budget (KV it will need beyond the prompt)


class Placement(Protocol):
    """A pure policy: no I/O, no state beyond its arguments. Returns an address among the
    snapshots, or raises `Reason.NO_HEALTHY_REPLICA`."""

    def choose(self, snapshots: Sequence[ReplicaSnapshot], request: PlacementView,
               exclude: frozenset[str] = frozenset()) -> str: ...


class ChunkSource(Protocol):
    """One request's engine output on one replica: `EngineChunk`s, or a `Broken` marker."""

    async def get(self) -> EngineChunk | Broken: ...


class EngineStream(Protocol):
    """The engine replicas as the core sees them."""

    def snapshots(self) -> Sequence[ReplicaSnapshot]: ...

    @property
    def max_context(self) -> int: ...

    def submit(self, address: str, request_id: str, prompt: list[int], sampling: Sampling,
               eos_ids: list[int], cache_salt: str, trace_context: dict[str, str], *,
               timeout: float = 0.0, priority: int = 0) -> ChunkSource:
        """`timeout`: seconds left for the request (0 = none), pushed down so the engine never
        starts it late; `priority`: its resolved priority (1 low .. 3 high) for engines that schedule."""
        ...

    def abort(self, address: str, request_id: str) -> None: ...

    def release(self, address: str, request_id: str) -> None: ...

    def mark_failed(self, address: str) -> None:
        """The replica's stream broke or stalled: one failure for its circuit breaker (suspect, no new
        work, until its next success)."""
        ...

    def heard(self, address: str) -> float:
        """Event-loop time of the last message this router received from the replica on its stream
        (tokens of any request, a load report, the engine's keepalive); 0 if none. A request the
        engine holds but has sent nothing for is stalled only when the whole stream is silent."""
        ...


class PoolSelector(Protocol):
    """Which engine pool serves a request (a weighted traffic split, sticky per tenant or session)."""

    def choose(self, tenant: str, session_id: str, request_id: str) -> str: ...


class Shadow(Protocol):
    """Mirrors a share of requests to a second pool and records its answers; never returns them to
    the client nor charges the tenant. `started` when the primary is placed, `finished` when it ends."""

    def started(self, state: RequestState) -> None: ...

    def finished(self, state: RequestState) -> None: ...


# ------------------------------------------------------------------------------------------ admission
@dataclass(frozen=True, slots=True)
class AdmitRequest:
    """What admission needs of a request: who, how urgent, what it costs, and the tenant's limits
    (resolved from the tenants file: the queue sees numbers, never the file)."""

    tenant: str
    request_id: str
    priority: int              # resolved: 1 low, 2 normal, 3 high
    cost: int                  # estimated tokens: prompt + max_tokens
    deadline: float            # seconds left (0 = none)
    max_in_flight: int
    max_queued: int
    tokens_per_minute: int = 0     # 0 = unlimited
    weight: float = 1.0


class Grant(Protocol):
    """An admitted request's lease. `settle(usage)` at the end (idempotent); it also releases."""

    async def settle(self, usage: Usage) -> None: ...


class Admitting(Protocol):
    """A request in admission: `grant` is set once it is granted; until then `position` is its
    place in the queue and `next()` waits for the next change (raising its typed failure)."""

    grant: Grant | None
    position: int

    async def next(self) -> None: ...

    def cancel(self) -> None:
        """Cancelled (any router's Cancel): fail the wait at once."""
        ...

    async def abandon(self) -> None:
        """The request will not run: leave the queue (a grant that raced in is given back)."""
        ...


class Admission(Protocol):
    def precheck(self, request: AdmitRequest) -> None:
        """Raise at once, with no I/O, a refusal admission already knows `request` would get
        (`request.cost`: the least it can cost, its prompt not tokenized yet); else nothing."""
        ...

    def predicts_refusal(self, request: AdmitRequest) -> bool:
        """Would `precheck` refuse `request` (its cost an estimate)? No I/O, nothing counted."""
        ...

    async def admit(self, request: AdmitRequest) -> Admitting:
        """Enqueue: granted at once, queued, or refused (ResourceExhausted / Unavailable with a
        reason and a retry-after). Cancellation while admitting leaves nothing behind."""
        ...


# --------------------------------------------------------------------------------- registry, sessions
class RequestRegistry(Protocol):
    """Request ids in flight, scoped by tenant: (tenant, id) pairs are independent across tenants,
    and no tenant can observe, block or cancel another's ids. `claim` is atomic. `remote`: a claim
    is a round trip (Redis) rather than answered in this process."""

    remote: bool

    async def claim(self, tenant: str, request_id: str) -> bool:
        """True if the id was free for this tenant (it is now held); False if in flight."""
        ...

    async def release(self, tenant: str, request_id: str, wait: bool = True) -> None:
        """Free the id: at once in this process; `wait` also waits (bounded) until every router
        sees it free (else that completes in the background)."""
        ...

    async def cancel(self, tenant: str, request_id: str) -> bool:
        """Cancel the tenant's request wherever it runs; False if it is not in flight (for this
        tenant: another tenant's id reads exactly like an unknown one)."""
        ...

    def on_cancel(self, tenant: str, request_id: str, callback: CancelCallback) -> None:
        """Call `callback()` when the request held by this process is cancelled (by any router).
        Dropped on `release`."""
        ...


class CancelCallback(Protocol):
    def __call__(self) -> None: ...


class SessionAffinity(Protocol):
    """Which engine replica holds a (tenant, session) — its prefix cache."""

    async def get(self, tenant: str, session_id: str) -> str: ...

    async def set(self, tenant: str, session_id: str, address: str) -> None: ...


# -------------------------------------------------------------------------------------------- overload
class Ticket(Protocol):
    def exit(self) -> None: ...


@runtime_checkable
class LoadGate(Protocol):
    """Called at the very start of each Generate / Chat turn: `enter()` returns a ticket, or raises
    a typed UNAVAILABLE reason (with a retry-after) when the router cannot serve in time."""

    def enter(self) -> Ticket: ...
