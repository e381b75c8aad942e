"""Adapters to the engine services: protobuf stays on this side of the edge.

The tokenizer's client (`TokenizerUpstream`, `DetokSession`) lives in router_svc/tokenizer_upstream.py
and is re-exported here. `EngineReplica` keeps one
multiplexed engine Stream and a circuit breaker (router_svc/breaker.py); `EnginePool` holds the
replicas, whose membership router_svc/discovery.py keeps (static, DNS, the Redis registry), and
tracks their load and health.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import grpc

from services.channels import CHANNEL_OPTIONS, open_channel
from services.errors import Reason
from services.frames import FrameCall
from services.logging import get_logger
from services.mux import Inbox, MuxClient, stream_error
from services.proto.tokenrelay.v1 import (
    common_pb2,
    engine_pb2,
    engine_pb2_grpc,
)
from services.security import PLAINTEXT, SecuritySettings
from services.wire import FINISH_NAMES

from . import metrics
from .breaker import DEFAULT_POLICY, POLL, Breaker, BreakerPolicy, BreakerState
from .ports import ReplicaSnapshot
from .tokenizer_upstream import DetokSession, TokenizerUpstream
from .types import EngineChunk, Sampling

log = get_logger(__name__)

__all__ = ["DEFAULT_POOL", "DetokSession", "EnginePool", "EngineReplica", "ReplicaLoad", "TokenizerUpstream"]

# How long a busy router may hold a request's new engine tokens so that they travel on together
# (services/mux.py): at most one delta per request per WAKE_DELAY while the loop lags.
WAKE_DELAY = 0.02



def frame_host(address: str) -> str:
    """The host of an engine's ``host:port`` address (``[v6]:port`` too), where its frame port is;
    "" for an address that names no single host (``dns:``, ``unix:``, ``ipv4:a,b``)."""
    if address.startswith("["):
        host, sep, _port = address[1:].partition("]:")
        return host if sep else ""
    if "/" in address or address.count(":") != 1 or "," in address:
        return ""
    host, _, _port = address.partition(":")
    return "" if host in ("unix", "dns", "ipv4", "ipv6") else host


def _rpc(exc: grpc.aio.AioRpcError, what: str) -> Exception:
    # One translation for every call to an upstream (mux streams and Tokenize use it too).
    return stream_error(exc, what)


# ---------------------------------------------------------------------------------------- tokenizer
# ------------------------------------------------------------------------------------------- engine
def _engine_build(pending: dict[str, list[Any]]) -> engine_pb2.EngineInbound:
    return engine_pb2.EngineInbound(submit=pending.get("submit", []), abort=pending.get("abort", []))


def _engine_split(resp: engine_pb2.EngineOutbound) -> list[tuple[str, engine_pb2.TokenChunk]]:
    return [(c.request_id, c) for c in resp.chunks]


def _engine_chunk(c: engine_pb2.TokenChunk) -> EngineChunk:
    return EngineChunk(list(c.token_ids), c.finished, FINISH_NAMES.get(c.finish_reason, "") if c.finished else "",
                       c.cached_tokens, c.error_reason, c.error_message)


def _engine_merge(pending: EngineChunk, c: engine_pb2.TokenChunk) -> bool:
    """Fold plain new tokens into the request's chunk that has not been taken yet (services/mux.py)."""
    if pending.finished or c.finished or c.cached_tokens or not pending.token_ids:
        return False
    pending.token_ids.extend(c.token_ids)
    return True


def _load_from_proto(r: engine_pb2.LoadReport) -> ReplicaLoad:
    return ReplicaLoad(r.active_requests, r.queued_requests, r.max_active_requests, r.kv_blocks_used,
                       r.kv_blocks_total, r.max_context, r.tokens_per_block)


@dataclass
class ReplicaLoad:
    active: int = 0
    queued: int = 0
    max_active: int = 0
    kv_used: int = 0
    kv_total: int = 0
    max_context: int = 0
    tokens_per_block: int = 0


DEFAULT_POOL = "default"
# In-band refusals by which an engine says it is not ready (draining, backend dead): out of rotation
# at once, not counted as failures by its breaker.
_NOT_READY = frozenset({Reason.SHUTTING_DOWN.value, Reason.ENGINE_UNAVAILABLE.value})
# A subchannel of its own per replica: one that comes back on the address it left (an engine
# restarted on its port) connects at once instead of inheriting the old connection's backoff.
_ENGINE_CHANNEL = (*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1))
RETIRE_MAX = 900.0      # seconds a retired replica's channel stays open for its in-flight requests
FRAMES_RETRY = 30.0     # seconds an engine's frame port that could not be connected to is left alone


@dataclass
class EngineReplica:
    """One engine replica: its channel, its multiplexed stream, its load and its circuit breaker.

    `healthy`: its breaker lets new work through (closed, or half-open with the probe slot free);
    `serving`: it is ready (False while it drains or its backend is dead: no new work, no failure).
    """

    address: str
    channel: grpc.aio.Channel
    stub: engine_pb2_grpc.EngineStub
    pool: str = DEFAULT_POOL
    breaker: Breaker = field(default_factory=Breaker)
    serving: bool = True          # False while the engine drains: it gets no new work
    load: ReplicaLoad = field(default_factory=ReplicaLoad)
    load_reports: int = 0         # reports received on the stream (not the poll)
    wake_delay: float = WAKE_DELAY
    probe: str = ""               # the request sent as the half-open breaker's probe
    frames: bool = False          # may use the engine's frame port (engine channels are plaintext)
    frame_port: int = 0           # the engine's frame port, from its load polls (0 = none: gRPC)
    frames_off_until: float = 0.0   # monotonic time until which its frame port is not tried again
    mux: MuxClient[EngineChunk] = field(init=False)

    def __post_init__(self) -> None:
        self._frame_host = frame_host(self.address)     # where its frame port is ("" = nowhere)
        self.mux = MuxClient(f"engine-{self.address}", self._open_stream, _engine_build, _engine_split,
                             on_message=self._on_message, max_wake_delay=self.wake_delay, convert=self._chunk,
                             merge=_engine_merge)

    @property
    def transport(self) -> str:
        """What the next stream opens: ``frames`` (the engine's frame port) or ``grpc``."""
        if self.frame_port and self._frame_host and time.monotonic() >= self.frames_off_until:
            return "frames"
        return "grpc"

    def _open_stream(self, requests: AsyncIterator[engine_pb2.EngineInbound]) -> Any:
        """The multiplexed stream's call: on the engine's frame port when it has one (services/frames.py),
        else its gRPC `Stream`. A frame port that is no frame stream (services/frames.py) is left alone
        for `FRAMES_RETRY` seconds; one that refuses hands its stream to gRPC (nothing was sent on it yet)."""
        if self.transport == "frames":
            metrics.ENGINE_STREAMS.labels("frames").inc()
            return FrameCall(self._frame_host, self.frame_port, requests, engine_pb2.EngineOutbound.FromString,
                             what=f"engine {self.address} frame port", on_unusable=self._frames_unusable,
                             fallback=self._grpc_stream)
        return self._grpc_stream(requests)

    def _grpc_stream(self, requests: AsyncIterator[engine_pb2.EngineInbound]) -> Any:
        metrics.ENGINE_STREAMS.labels("grpc").inc()
        return self.stub.Stream(requests)

    def _frames_unusable(self, exc: BaseException) -> None:
        self.frames_off_until = time.monotonic() + FRAMES_RETRY
        log.warning("engine_frame_port_unreachable", address=self.address, port=self.frame_port,
                    error=str(exc) or type(exc).__name__, retry_in=FRAMES_RETRY)

    @property
    def healthy(self) -> bool:
        return self.breaker.available()

    @property
    def state(self) -> str:
        """ready | suspect | draining | open | half_open (the replicas gauge's label)."""
        if not self.serving:
            return "draining"
        state = self.breaker.state
        if state is BreakerState.CLOSED:
            return "suspect" if self.breaker.suspect else "ready"
        return state.value

    def _on_message(self, resp: engine_pb2.EngineOutbound) -> None:
        if resp.HasField("load"):   # load rides on the stream (module doc of engine.proto)
            self.apply_load(resp.load)
            self.load_reports += 1
        # Checked once per message, not per chunk (the hot path): a message with tokens or a
        # finish shows it works: the failure count restarts, a half-open probe closes.
        if not self.breaker.clean():
            for c in resp.chunks:
                if not c.error_reason and (c.token_ids or c.finished):
                    self.breaker.success()
                    break

    def _chunk(self, c: engine_pb2.TokenChunk) -> EngineChunk:
        chunk = _engine_chunk(c)
        if chunk.error_reason and chunk.error_reason in _NOT_READY:
            self.set_serving(False)
        return chunk

    def apply_load(self, r: engine_pb2.LoadReport, *, polled: bool = False) -> None:
        self.load = _load_from_proto(r)
        if polled:     # the stream's own reports do not carry it
            self.frame_port = r.frame_port if self.frames else 0
        self.set_serving(not r.draining)

    def set_serving(self, serving: bool) -> None:
        if self.serving != serving:
            log.info("engine_serving" if serving else "engine_draining", address=self.address, pool=self.pool)
        self.serving = serving

    @property
    def in_flight(self) -> int:
        return self.mux.open_requests

    def snapshot(self) -> ReplicaSnapshot:
        load = self.load
        return ReplicaSnapshot(self.address, self.healthy, self.serving, self.in_flight, load.queued, load.active,
                               load.max_active, load.kv_used, load.kv_total, pool=self.pool,
                               tokens_per_block=load.tokens_per_block)

    def submit(self, request_id: str, prompt: list[int], sampling: Sampling, eos_ids: list[int],
               cache_salt: str, trace_context: dict[str, str], *, timeout: float = 0.0,
               priority: int = 0) -> Inbox[EngineChunk]:
        queue = self.mux.open(request_id)
        if self.breaker.state is BreakerState.HALF_OPEN and self.breaker.try_probe():
            self.probe = request_id
        params = common_pb2.SamplingParams(
            max_tokens=sampling.max_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
            top_k=sampling.top_k, stop_token_ids=sampling.stop_token_ids, ignore_eos=sampling.ignore_eos)
        if sampling.seed is not None:
            params.seed = sampling.seed
        self.mux.post("submit", engine_pb2.EngineRequest(
            request_id=request_id, prompt_token_ids=prompt, sampling=params, eos_token_ids=eos_ids,
            cache_salt=cache_salt, trace_context=trace_context,
            timeout_ms=max(1, int(timeout * 1000)) if timeout > 0 else 0,
            priority=cast(common_pb2.Priority, priority)))
        return queue

    def abort(self, request_id: str) -> None:
        self.mux.post("abort", request_id)

    def release(self, request_id: str) -> bool:
        """The request lets go of this replica; whether it still held it (a second release: False)."""
        held = self.mux.release(request_id)
        if request_id == self.probe:
            self.probe = ""
            self.breaker.probe_done()    # ended without an outcome (a failure was reported before this)
        return held

    def failed(self) -> None:
        """Its stream broke or stalled: a failure for the breaker, unless it said it is not ready."""
        if self.serving:
            self.breaker.failure()

    async def close(self) -> None:
        await self.mux.close()
        await self.channel.close()


# (added addresses, removed addresses): called on every change of an `EnginePool`'s membership.
MembershipListener = Callable[[list[str], list[str]], None]


class EnginePool:
    """Engine replicas with dynamic membership, load, health (a circuit breaker each) and the
    legacy in-process session affinity of `pick()`.

    Membership: `add(pool, address)` and `remove(address)` (router_svc/discovery.py calls them).
    A removed replica leaves rotation at once; with ``now=True`` (its registry entry expired) its
    stream is closed at once, its in-flight requests failing as retryable; otherwise it is retired:
    closed once its requests end. `add_listener(cb)` hears every change as (added, removed).

    Health: a load poll (GetLoad) every `poll_interval` seconds feeds every replica's breaker
    (router_svc/breaker.py) and its load; broken or stalled streams (`mark_failed`) count as
    failures too; an engine that reports it drains, or refuses work as not ready, is out of
    rotation without counting as a failure. A replica whose breaker is open is not polled until
    its backoff has passed; then one poll (or one request) is its probe.
    """

    def __init__(self, addresses: Sequence[str] = (), poll_interval: float = 1.0, session_capacity: int = 100_000,
                 *, security: SecuritySettings = PLAINTEXT, wake_delay: float = WAKE_DELAY,
                 breaker: BreakerPolicy = DEFAULT_POLICY, poll_timeout: float = 2.0,
                 clock: Callable[[], float] = time.monotonic, frames: bool = True) -> None:
        self._security = security
        # An engine's frame port is plaintext: used only while the engine channels are too.
        self._frames = frames and security.channel_mode == "plaintext"
        self._wake_delay = wake_delay
        self._policy = breaker
        self._clock = clock
        self._by_address: dict[str, EngineReplica] = {}
        self._retiring: dict[str, tuple[EngineReplica, float]] = {}
        self._listeners: list[MembershipListener] = []
        self._poll_interval = poll_interval
        self._poll_timeout = poll_timeout
        self._sessions: OrderedDict[str, EngineReplica] = OrderedDict()
        self._session_capacity = session_capacity
        self._poller: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._gauge_labels: set[tuple[str, str]] = set()
        # Told when a request lets go of a replica (its in-flight count fell): the placement share
        # sends the new count this loop iteration, not at its next tick (router_svc/placement_share.py).
        self.on_release: Callable[[], None] | None = None
        for address in addresses:
            self.add(DEFAULT_POOL, address)

    # -- membership ---------------------------------------------------------------------------
    @property
    def replicas(self) -> list[EngineReplica]:
        """The replicas in the pool now (retired ones excluded)."""
        return list(self._by_address.values())

    def addresses(self) -> list[str]:
        return list(self._by_address)

    def add_listener(self, callback: MembershipListener) -> None:
        self._listeners.append(callback)

    def add(self, pool: str, address: str, load: ReplicaLoad | None = None) -> bool:
        """Put a replica in the pool (True if it was not there); a retired one not yet closed comes
        back as it is."""
        replica = self._by_address.get(address)
        if replica is not None:
            if replica.pool != pool:
                log.info("engine_pool_changed", address=address, pool=pool, was=replica.pool)
                replica.pool = pool
            return False
        retired = self._retiring.pop(address, None)
        if retired is not None:
            replica = retired[0]
            replica.pool = pool
        else:
            channel = open_channel(address, self._security, options=_ENGINE_CHANNEL)
            replica = EngineReplica(address, channel, engine_pb2_grpc.EngineStub(channel), pool,
                                    Breaker(self._policy, clock=self._clock, on_transition=self._transition,
                                            on_change=lambda _b: self._update_gauges(), name=address),
                                    wake_delay=self._wake_delay, frames=self._frames)
            if load is not None:
                replica.load = load
        self._by_address[address] = replica
        log.info("engine_added", address=address, pool=pool, replicas=len(self._by_address))
        metrics.REPLICA_CHANGES.labels("added").inc()
        if self._poller is not None:   # started: learn its load and health now, not at the next tick
            self._spawn(self._poll(replica), f"engine-first-poll-{address}")
        self._changed([address], [])
        return True

    def remove(self, address: str, *, now: bool = False) -> bool:
        """Take a replica out of the pool (True if it was there): at once with ``now`` (its
        in-flight streams fail as retryable), else once its requests end."""
        replica = self._by_address.pop(address, None)
        if replica is None:
            retired = self._retiring.pop(address, None) if now else None
            if retired is not None:
                self._spawn(retired[0].close(), f"engine-close-{address}")
            return False
        for session, held in list(self._sessions.items()):
            if held is replica:
                del self._sessions[session]
        log.info("engine_removed", address=address, pool=replica.pool, expired=now, in_flight=replica.in_flight)
        metrics.REPLICA_CHANGES.labels("expired" if now else "removed").inc()
        if now or not replica.in_flight:
            self._spawn(replica.close(), f"engine-close-{address}")
        else:
            self._retiring[address] = (replica, self._clock() + RETIRE_MAX)
        self._changed([], [address])
        return True

    def set_draining(self, address: str) -> None:
        """The registry says the replica drains: no new work (its own reports say so too, soon)."""
        replica = self._by_address.get(address)
        if replica is not None:
            replica.set_serving(False)

    def _changed(self, added: list[str], removed: list[str]) -> None:
        self._update_gauges()
        for callback in list(self._listeners):
            try:
                callback(added, removed)
            except Exception:   # a listener's bug must not stop membership
                log.exception("engine_listener_failed")

    def _reap(self) -> None:
        """Close retired replicas whose requests have ended (or that waited too long)."""
        now = self._clock()
        for address, (replica, deadline) in list(self._retiring.items()):
            if not replica.in_flight or now >= deadline:
                del self._retiring[address]
                self._spawn(replica.close(), f"engine-close-{address}")

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- health -------------------------------------------------------------------------------
    def _transition(self, breaker: Breaker, before: BreakerState, to: BreakerState) -> None:
        metrics.BREAKER_TRANSITIONS.labels(to.value).inc()
        if to is BreakerState.OPEN:
            log.warning("engine_breaker_open", address=breaker.name, failures=breaker.consecutive,
                        backoff=breaker.backoff, was=before.value)
        else:
            log.info(f"engine_breaker_{to.value}", address=breaker.name, was=before.value)

    def _update_gauges(self) -> None:
        counts: dict[tuple[str, str], int] = {}
        for r in self._by_address.values():
            key = (r.pool, r.state)
            counts[key] = counts.get(key, 0) + 1
        for key in self._gauge_labels - set(counts):
            metrics.ENGINE_REPLICAS.labels(*key).set(0)
        for key, n in counts.items():
            metrics.ENGINE_REPLICAS.labels(*key).set(n)
        self._gauge_labels |= set(counts)

    async def start(self) -> None:
        await self.poll_once()
        self._poller = asyncio.create_task(self._poll_forever(), name="engine-load-poller")

    async def poll_once(self) -> None:
        await asyncio.gather(*(self._poll(r) for r in self.replicas))
        self._reap()
        self._update_gauges()

    async def _poll(self, replica: EngineReplica) -> None:
        if replica.breaker.state is BreakerState.OPEN:
            return      # backing off: the first poll after the backoff is its probe
        try:
            r = await replica.stub.GetLoad(engine_pb2.LoadRequest(), timeout=self._poll_timeout)
        except (grpc.aio.AioRpcError, grpc.aio.UsageError) as exc:
            code = exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else "CLOSED"
            if not replica.serving:
                return      # a draining engine stops answering at the end of its drain: no failure
            if replica.breaker.clean(POLL):
                log.warning("engine_poll_failed", address=replica.address, error=code)
            replica.breaker.failure(POLL)
            return
        replica.apply_load(r, polled=True)
        replica.breaker.success(POLL)

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self._poll_interval)
            await self.poll_once()

    @property
    def max_context(self) -> int:
        contexts = [r.load.max_context for r in self.replicas if r.load.max_context]
        return min(contexts) if contexts else 0

    def pick(self, session_id: str = "", exclude: frozenset[str] = frozenset()) -> EngineReplica:
        if session_id:
            held = self._sessions.get(session_id)
            if held is not None and held.healthy and held.serving and held.address not in exclude:
                self._sessions.move_to_end(session_id)
                return held
        candidates = [r for r in self.replicas if r.healthy and r.serving and r.address not in exclude]
        if not candidates:
            raise Reason.NO_HEALTHY_REPLICA.error("no healthy engine replica")
        chosen = min(candidates, key=lambda r: (r.in_flight + r.load.queued, r.load.active))
        if session_id:
            self._sessions[session_id] = chosen
            self._sessions.move_to_end(session_id)
            while len(self._sessions) > self._session_capacity:
                self._sessions.popitem(last=False)
        return chosen

    def _find(self, address: str) -> EngineReplica | None:
        replica = self._by_address.get(address)
        if replica is None and address in self._retiring:
            replica = self._retiring[address][0]
        return replica

    def mark_failed(self, replica: EngineReplica | str) -> None:
        """The replica's stream broke or stalled: one failure for its breaker, so suspect (no new
        work) until its next success (none if it said it is not ready; nothing if it has left)."""
        found = self._find(replica) if isinstance(replica, str) else replica
        if found is not None:
            found.failed()

    def heard(self, address: str) -> float:
        """Loop time of the last message from the replica's stream (0: none, or it has left)."""
        found = self._find(address)
        return found.mux.last_received if found is not None else 0.0

    # -- ports.EngineStream --------------------------------------------------------------------
    def snapshots(self) -> list[ReplicaSnapshot]:
        return [r.snapshot() for r in self._by_address.values()]

    def replica(self, address: str) -> EngineReplica:
        replica = self._by_address.get(address)
        if replica is None:
            raise Reason.NO_HEALTHY_REPLICA.error(f"no engine replica {address!r}")
        return replica

    def submit(self, address: str, request_id: str, prompt: list[int], sampling: Sampling, eos_ids: list[int],
               cache_salt: str, trace_context: dict[str, str], *, timeout: float = 0.0,
               priority: int = 0) -> Inbox[EngineChunk]:
        """Submit on the replica at `address`; chunks arrive in the returned inbox (`get()` one,
        `get_ready()` every chunk ready now)."""
        return self.replica(address).submit(request_id, prompt, sampling, eos_ids, cache_salt, trace_context,
                                            timeout=timeout, priority=priority)

    def abort(self, address: str, request_id: str) -> None:
        """Abort on the replica (a retired one too); nothing if it has been closed."""
        replica = self._find(address)
        if replica is not None:
            replica.abort(request_id)

    def release(self, address: str, request_id: str) -> None:
        replica = self._find(address)
        if replica is not None and replica.release(request_id) and self.on_release is not None:
            self.on_release()

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        replicas = [*self._by_address.values(), *(r for r, _ in self._retiring.values())]
        self._by_address.clear()
        self._retiring.clear()
        for r in replicas:
            await r.close()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
