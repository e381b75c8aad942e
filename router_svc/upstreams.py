"""Adapters to the tokenizer and engine services: protobuf stays on this side of the edge.

`TokenizerUpstream` batches nothing itself (the tokenizer service batches concurrent calls) but
keeps one multiplexed Detokenize stream per tokenizer replica. `EngineReplica` keeps one
multiplexed engine Stream; `EnginePool` tracks replicas' load and health and picks one.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, cast

import grpc

from services.channels import open_channel
from services.errors import Reason
from services.logging import get_logger
from services.mux import Inbox, MuxClient, StreamBroken, stream_error
from services.proto.tokenrelay.v1 import (
    common_pb2,
    engine_pb2,
    engine_pb2_grpc,
    tokenizer_pb2,
    tokenizer_pb2_grpc,
)
from services.security import PLAINTEXT, SecuritySettings
from services.wire import FINISH_NAMES

from .ports import ReplicaSnapshot
from .tokenize_batch import MAX_BYTES, MAX_CALLS, TokenizeCoalescer
from .types import DetokOut, EngineChunk, Sampling, TokenizerMeta

log = get_logger(__name__)

# How long a busy router may hold a request's new engine tokens so that they travel on together
# (services/mux.py): at most one delta per request per WAKE_DELAY while the loop lags.
WAKE_DELAY = 0.02



def _rpc(exc: grpc.aio.AioRpcError, what: str) -> Exception:
    # One translation for every call to an upstream (mux streams and Tokenize use it too).
    return stream_error(exc, what)


# ---------------------------------------------------------------------------------------- tokenizer
def _detok_build(pending: dict[str, list[Any]]) -> tokenizer_pb2.DetokenizeRequest:
    return tokenizer_pb2.DetokenizeRequest(open=pending.get("open", []), tokens=pending.get("tokens", []),
                                           close=pending.get("close", []))


def _detok_split(resp: tokenizer_pb2.DetokenizeResponse) -> list[tuple[str, tokenizer_pb2.DetokOutput]]:
    return [(o.request_id, o) for o in resp.outputs]


def _detok_out(o: tokenizer_pb2.DetokOutput) -> DetokOut:
    return DetokOut(o.text, o.finished, o.matched_stop, o.tokens_consumed, o.error)


def _detok_merge(pending: DetokOut, o: tokenizer_pb2.DetokOutput) -> bool:
    """Append new text to the request's output that has not been taken yet (services/mux.py)."""
    if pending.finished or pending.error or o.finished or o.error or o.matched_stop:
        return False
    pending.text += o.text
    pending.tokens_consumed = o.tokens_consumed
    return True


class DetokSession:
    """One request's incremental detokenization on a shared stream."""

    def __init__(self, mux: MuxClient[DetokOut], request_id: str) -> None:
        self._mux = mux
        self.request_id = request_id
        self.queue = mux.open(request_id)
        self._closed = False

    def start(self, stop: list[str], include_stop: bool, prefix_ids: list[int],
              trace_context: dict[str, str]) -> None:
        self._mux.post("open", tokenizer_pb2.DetokOpen(
            request_id=self.request_id, stop=stop, include_stop_str=include_stop,
            skip_special_tokens=True, prefix_ids=prefix_ids, trace_context=trace_context))

    def send(self, token_ids: list[int], final: bool) -> None:
        self._mux.post("tokens", tokenizer_pb2.DetokTokens(
            request_id=self.request_id, token_ids=token_ids, final=final))

    async def next(self) -> DetokOut | StreamBroken:
        return await self.queue.get()

    async def next_ready(self) -> list[DetokOut | StreamBroken]:
        """Every output ready now, waiting only when none is (one client write carries them all)."""
        return await self.queue.get_ready()

    def fail(self, error: Exception) -> None:
        self.queue.put_nowait(StreamBroken(error))  # type: ignore[arg-type]

    def close(self, flushed: bool) -> None:
        if self._closed:
            return
        self._closed = True
        if not flushed:
            self._mux.post("close", tokenizer_pb2.DetokClose(request_id=self.request_id))
        self._mux.release(self.request_id)


class TokenizerUpstream:
    def __init__(self, addresses: list[str], timeout: float, *, max_calls: int = MAX_CALLS,
                 max_bytes: int = MAX_BYTES, security: SecuritySettings = PLAINTEXT) -> None:
        if not addresses:
            raise ValueError("at least one tokenizer address is required")
        self._timeout = timeout
        self._channels = [open_channel(a, security) for a in addresses]
        self._stubs = [tokenizer_pb2_grpc.TokenizerStub(c) for c in self._channels]
        self._rr = itertools.cycle(range(len(addresses)))
        self._muxes: list[MuxClient[DetokOut]] = [
            MuxClient(f"detok-{a}", stub.Detokenize, _detok_build, _detok_split, convert=_detok_out,
                      merge=_detok_merge)
            for a, stub in zip(addresses, self._stubs, strict=True)]
        self._batchers = [TokenizeCoalescer(stub, timeout, max_calls=max_calls, max_bytes=max_bytes)
                          for stub in self._stubs]
        self.meta: TokenizerMeta | None = None

    async def info(self) -> TokenizerMeta:
        try:
            r = await self._stubs[0].Info(tokenizer_pb2.InfoRequest(), timeout=self._timeout)
        except grpc.aio.AioRpcError as exc:
            raise _rpc(exc, "tokenizer") from exc
        self.meta = TokenizerMeta(r.name, r.vocab_size, list(r.eos_token_ids),
                                  r.bos_token_id if r.HasField("bos_token_id") else None,
                                  r.max_context, r.has_chat_template)
        return self.meta

    async def tokenize(self, *, text: str | None = None, messages: list[tuple[str, str]] | None = None,
                       timeout: float | None = None, cache_key: str = "") -> list[int]:
        """Ids of a text or a chat. With `cache_key` (a chat session) every call goes to the same
        replica, whose prefix cache then tokenizes only the new part of each turn."""
        if messages is not None:
            item = tokenizer_pb2.TokenizeInput(chat=tokenizer_pb2.ChatMessages(
                messages=[common_pb2.ChatMessage(role=r, content=c) for r, c in messages],
                add_generation_prompt=True, cache_key=cache_key))
        else:
            item = tokenizer_pb2.TokenizeInput(text=text or "", add_special_tokens=True)
        index = zlib.crc32(cache_key.encode()) % len(self._stubs) if cache_key else next(self._rr)
        try:
            return await self._batchers[index].tokenize(item, min(filter(None, (timeout, self._timeout))))
        except asyncio.TimeoutError:
            raise Reason.TOKENIZE_TIMEOUT.error("tokenization did not finish in time") from None

    def detokenizer(self, request_id: str) -> DetokSession:
        mux = min(self._muxes, key=lambda m: m.open_requests)
        return DetokSession(mux, request_id)

    async def close(self) -> None:
        for batcher in self._batchers:
            await batcher.close()
        for mux in self._muxes:
            await mux.close()
        for channel in self._channels:
            await channel.close()


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
                       r.kv_blocks_total, r.max_context)


@dataclass
class ReplicaLoad:
    active: int = 0
    queued: int = 0
    max_active: int = 0
    kv_used: int = 0
    kv_total: int = 0
    max_context: int = 0


@dataclass
class EngineReplica:
    address: str
    channel: grpc.aio.Channel
    stub: engine_pb2_grpc.EngineStub
    mux: MuxClient[EngineChunk] = field(init=False)
    healthy: bool = True
    serving: bool = True          # False while the engine drains: it gets no new work
    load: ReplicaLoad = field(default_factory=ReplicaLoad)
    load_reports: int = 0         # reports received on the stream (not the poll)
    wake_delay: float = WAKE_DELAY

    def __post_init__(self) -> None:
        self.mux = MuxClient(f"engine-{self.address}", self.stub.Stream, _engine_build, _engine_split,
                             on_message=self._on_message, max_wake_delay=self.wake_delay, convert=_engine_chunk,
                             merge=_engine_merge)

    def _on_message(self, resp: engine_pb2.EngineOutbound) -> None:
        if resp.HasField("load"):   # load rides on the stream (module doc of engine.proto)
            self.apply_load(resp.load)
            self.load_reports += 1

    def apply_load(self, r: engine_pb2.LoadReport) -> None:
        self.load = _load_from_proto(r)
        if self.serving == r.draining:
            log.info("engine_draining" if r.draining else "engine_serving", address=self.address)
        self.serving = not r.draining

    @property
    def in_flight(self) -> int:
        return self.mux.open_requests

    def snapshot(self) -> ReplicaSnapshot:
        load = self.load
        return ReplicaSnapshot(self.address, self.healthy, self.serving, self.in_flight, load.queued, load.active,
                               load.max_active, load.kv_used, load.kv_total)

    def submit(self, request_id: str, prompt: list[int], sampling: Sampling, eos_ids: list[int],
               cache_salt: str, trace_context: dict[str, str], *, timeout: float = 0.0,
               priority: int = 0) -> Inbox[EngineChunk]:
        queue = self.mux.open(request_id)
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

    def release(self, request_id: str) -> None:
        self.mux.release(request_id)


class EnginePool:
    """Engine replicas with health, load and session affinity.

    Choice: the replica that holds the session if it is healthy, else the healthy replica with
    the least outstanding work (this router's in-flight plus the engine's reported queue).
    Prefix-aware scoring is a later issue.
    """

    def __init__(self, addresses: list[str], poll_interval: float, session_capacity: int = 100_000, *,
                 security: SecuritySettings = PLAINTEXT, wake_delay: float = WAKE_DELAY) -> None:
        if not addresses:
            raise ValueError("at least one engine address is required")
        self.replicas: list[EngineReplica] = []
        for address in addresses:
            channel = open_channel(address, security)
            self.replicas.append(EngineReplica(address, channel, engine_pb2_grpc.EngineStub(channel),
                                               wake_delay=wake_delay))
        self._by_address = {r.address: r for r in self.replicas}
        self._poll_interval = poll_interval
        self._sessions: OrderedDict[str, EngineReplica] = OrderedDict()
        self._session_capacity = session_capacity
        self._poller: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.poll_once()
        self._poller = asyncio.create_task(self._poll_forever(), name="engine-load-poller")

    async def poll_once(self) -> None:
        await asyncio.gather(*(self._poll(r) for r in self.replicas))

    async def _poll(self, replica: EngineReplica) -> None:
        try:
            r = await replica.stub.GetLoad(engine_pb2.LoadRequest(), timeout=2.0)
        except grpc.aio.AioRpcError as exc:
            if replica.healthy:
                log.warning("engine_unhealthy", address=replica.address, error=exc.code().name)
            replica.healthy = False
            return
        if not replica.healthy:
            log.info("engine_healthy", address=replica.address)
        replica.healthy = True
        replica.apply_load(r)

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
            if held is not None and held.healthy and held.address not in exclude:
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

    def mark_failed(self, replica: EngineReplica | str) -> None:
        """The replica's stream broke or stalled: no new work until a poll sees it healthy."""
        replica = self._by_address[replica] if isinstance(replica, str) else replica
        replica.healthy = False

    # -- ports.EngineStream --------------------------------------------------------------------
    def snapshots(self) -> list[ReplicaSnapshot]:
        return [r.snapshot() for r in self.replicas]

    def replica(self, address: str) -> EngineReplica:
        try:
            return self._by_address[address]
        except KeyError:
            raise Reason.NO_HEALTHY_REPLICA.error(f"no engine replica {address!r}") from None

    def submit(self, address: str, request_id: str, prompt: list[int], sampling: Sampling, eos_ids: list[int],
               cache_salt: str, trace_context: dict[str, str], *, timeout: float = 0.0,
               priority: int = 0) -> Inbox[EngineChunk]:
        """Submit on the replica at `address`; chunks arrive in the returned inbox (`get()` one,
        `get_ready()` every chunk ready now)."""
        return self.replica(address).submit(request_id, prompt, sampling, eos_ids, cache_salt, trace_context,
                                            timeout=timeout, priority=priority)

    def abort(self, address: str, request_id: str) -> None:
        self.replica(address).abort(request_id)

    def release(self, address: str, request_id: str) -> None:
        self.replica(address).release(request_id)

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        for r in self.replicas:
            await r.mux.close()
            await r.channel.close()
