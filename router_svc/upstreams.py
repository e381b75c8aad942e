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
from typing import Any

import grpc

from services.channels import open_channel
from services.errors import Reason, from_rpc_error
from services.logging import get_logger
from services.mux import MuxClient, StreamBroken
from services.proto.tokenrelay.v1 import (
    common_pb2,
    engine_pb2,
    engine_pb2_grpc,
    tokenizer_pb2,
    tokenizer_pb2_grpc,
)
from services.security import PLAINTEXT, SecuritySettings
from services.wire import FINISH_NAMES

from .tokenize_batch import MAX_BYTES, MAX_CALLS, TokenizeCoalescer
from .types import DetokOut, EngineChunk, Sampling, TokenizerMeta

log = get_logger(__name__)



def _rpc(exc: grpc.aio.AioRpcError, what: str) -> Exception:
    err = from_rpc_error(exc)
    if err.reason in (Reason.UPSTREAM_UNAVAILABLE, Reason.DEADLINE_EXCEEDED):
        err.message = f"{what}: {err.message}"
    return err


# ---------------------------------------------------------------------------------------- tokenizer
def _detok_build(pending: dict[str, list[Any]]) -> tokenizer_pb2.DetokenizeRequest:
    return tokenizer_pb2.DetokenizeRequest(open=pending.get("open", []), tokens=pending.get("tokens", []),
                                           close=pending.get("close", []))


def _detok_split(resp: tokenizer_pb2.DetokenizeResponse) -> list[tuple[str, DetokOut]]:
    return [(o.request_id, DetokOut(o.text, o.finished, o.matched_stop, o.tokens_consumed, o.error))
            for o in resp.outputs]


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
            MuxClient(f"detok-{a}", stub.Detokenize, _detok_build, _detok_split)
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


def _engine_split(resp: engine_pb2.EngineOutbound) -> list[tuple[str, EngineChunk]]:
    return [(c.request_id, EngineChunk(list(c.token_ids), c.finished, FINISH_NAMES.get(c.finish_reason, ""),
                                       c.cached_tokens, c.error_reason, c.error_message))
            for c in resp.chunks]


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
    mux: MuxClient[EngineChunk]
    healthy: bool = True
    load: ReplicaLoad = field(default_factory=ReplicaLoad)

    @property
    def in_flight(self) -> int:
        return self.mux.open_requests

    def submit(self, request_id: str, prompt: list[int], sampling: Sampling, eos_ids: list[int],
               cache_salt: str, trace_context: dict[str, str]) -> asyncio.Queue[EngineChunk | StreamBroken]:
        queue = self.mux.open(request_id)
        params = common_pb2.SamplingParams(
            max_tokens=sampling.max_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
            top_k=sampling.top_k, stop_token_ids=sampling.stop_token_ids, ignore_eos=sampling.ignore_eos)
        if sampling.seed is not None:
            params.seed = sampling.seed
        self.mux.post("submit", engine_pb2.EngineRequest(
            request_id=request_id, prompt_token_ids=prompt, sampling=params, eos_token_ids=eos_ids,
            cache_salt=cache_salt, trace_context=trace_context))
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
                 security: SecuritySettings = PLAINTEXT) -> None:
        if not addresses:
            raise ValueError("at least one engine address is required")
        self.replicas: list[EngineReplica] = []
        for address in addresses:
            channel = open_channel(address, security)
            stub = engine_pb2_grpc.EngineStub(channel)
            mux: MuxClient[EngineChunk] = MuxClient(f"engine-{address}", stub.Stream, _engine_build,
                                                    _engine_split)
            self.replicas.append(EngineReplica(address, channel, stub, mux))
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
        replica.load = ReplicaLoad(r.active_requests, r.queued_requests, r.max_active_requests,
                                   r.kv_blocks_used, r.kv_blocks_total, r.max_context)

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
        candidates = [r for r in self.replicas if r.healthy and r.address not in exclude]
        if not candidates:
            raise Reason.NO_HEALTHY_REPLICA.error("no healthy engine replica")
        chosen = min(candidates, key=lambda r: (r.in_flight + r.load.queued, r.load.active))
        if session_id:
            self._sessions[session_id] = chosen
            self._sessions.move_to_end(session_id)
            while len(self._sessions) > self._session_capacity:
                self._sessions.popitem(last=False)
        return chosen

    def mark_failed(self, replica: EngineReplica) -> None:
        replica.healthy = False

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        for r in self.replicas:
            await r.mux.close()
            await r.channel.close()
