"""The router's client of the tokenizer service: coalesced Tokenize calls and one multiplexed
Detokenize stream per replica, over a membership that may change while it serves.

Membership (`sync`): the replicas are the addresses last given; `dns:` entries of `--tokenizers`
are read again every `--dns-interval` (`router_svc/discovery.py` `TokenizerDiscovery`), so a
tokenizer Deployment scaled up or down in Kubernetes is followed without a router restart. A new
replica gets work at once; one no longer listed gets no new work and is closed once its Detokenize
sessions have ended (its in-flight Tokenize calls end on their own). The last replica is never
retired (an empty reading keeps the previous list: a DNS hiccup is not a scale-to-zero).

Health: a replica whose call or stream failed on the transport gets no new work for
`TOKENIZER_DOWN_FOR` (it is probed again after that), and no new Detokenize session until a
Tokenize call there succeeded again: a dead tokenizer costs its in-flight requests, not every
request sent to it until it is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from services.channels import open_channel
from services.errors import Reason, TokenrelayError
from services.logging import get_logger
from services.mux import MuxClient, StreamBroken, stream_error
from services.proto.tokenrelay.v1 import common_pb2, tokenizer_pb2, tokenizer_pb2_grpc
from services.security import PLAINTEXT, SecuritySettings

from .tokenize_batch import MAX_BYTES, MAX_CALLS, TokenizeCoalescer
from .types import DetokOut, TokenizerMeta

log = get_logger(__name__)

# Seconds a tokenizer replica whose call or stream failed on the transport gets no new work.
TOKENIZER_DOWN_FOR = 1.0


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


@dataclass(eq=False)
class _Replica:
    address: str
    channel: grpc.aio.Channel
    stub: tokenizer_pb2_grpc.TokenizerStub
    mux: MuxClient[DetokOut]
    batcher: TokenizeCoalescer
    down_until: float = 0.0
    suspect: bool = False       # no new Detokenize session until a Tokenize call succeeded here
    retiring: bool = False      # no longer listed: no new work, closed once idle
    closer: asyncio.Task[None] | None = field(default=None, repr=False)

    @property
    def up(self) -> bool:
        return not self.retiring and time.monotonic() >= self.down_until


class TokenizerUpstream:
    def __init__(self, addresses: list[str], timeout: float, *, max_calls: int = MAX_CALLS,
                 max_bytes: int = MAX_BYTES, security: SecuritySettings = PLAINTEXT) -> None:
        if not addresses:
            raise ValueError("at least one tokenizer address is required")
        self._timeout = timeout
        self._max_calls, self._max_bytes, self._security = max_calls, max_bytes, security
        self._replicas: list[_Replica] = [self._open(a) for a in dict.fromkeys(addresses)]
        self._retired: list[_Replica] = []
        self._turn = 0
        self.meta: TokenizerMeta | None = None

    def _open(self, address: str) -> _Replica:
        channel = open_channel(address, self._security)
        stub = tokenizer_pb2_grpc.TokenizerStub(channel)
        made: list[_Replica] = []     # the mux's callback names the replica it is part of
        mux: MuxClient[DetokOut] = MuxClient(f"detok-{address}", stub.Detokenize, _detok_build, _detok_split,
                                             convert=_detok_out, merge=_detok_merge,
                                             on_broken=lambda _error: self._mark_down(made[0]))
        made.append(_Replica(address, channel, stub, mux,
                             TokenizeCoalescer(stub, self._timeout, max_calls=self._max_calls,
                                               max_bytes=self._max_bytes)))
        return made[0]

    # -- membership -----------------------------------------------------------------------------
    @property
    def addresses(self) -> list[str]:
        return [r.address for r in self._replicas]

    def sync(self, addresses: Sequence[str]) -> None:
        """Serve exactly `addresses` from now on (module doc); an empty list changes nothing."""
        wanted = list(dict.fromkeys(addresses))
        if not wanted or wanted == self.addresses:
            return
        have = {r.address: r for r in self._replicas}
        kept = [have[a] if a in have else self._open(a) for a in wanted]
        for address in wanted:
            if address not in have:
                log.info("tokenizer_added", address=address)
        for replica in self._replicas:
            if replica.address not in wanted:
                log.info("tokenizer_retired", address=replica.address, sessions=replica.mux.open_requests)
                replica.retiring = True
                replica.closer = asyncio.get_running_loop().create_task(self._close_when_idle(replica),
                                                                       name=f"tokenizer-retire-{replica.address}")
                self._retired.append(replica)
        self._replicas = kept

    async def _close_when_idle(self, replica: _Replica, poll: float = 0.5) -> None:
        """A retired replica's streams and calls end on their own; then it is closed (bounded)."""
        deadline = time.monotonic() + max(self._timeout, 60.0)
        while replica.mux.open_requests and time.monotonic() < deadline:
            await asyncio.sleep(poll)   # the sessions' own ends: polled, bounded, once per retirement
        await self._close_replica(replica)
        with contextlib.suppress(ValueError):
            self._retired.remove(replica)

    @staticmethod
    async def _close_replica(replica: _Replica) -> None:
        await replica.batcher.close()
        await replica.mux.close()
        await replica.channel.close()

    # -- calls ----------------------------------------------------------------------------------
    async def info(self) -> TokenizerMeta:
        try:
            r = await self._replicas[0].stub.Info(tokenizer_pb2.InfoRequest(), timeout=self._timeout)
        except grpc.aio.AioRpcError as exc:
            raise stream_error(exc, "tokenizer") from exc
        self.meta = TokenizerMeta(r.name, r.vocab_size, list(r.eos_token_ids),
                                  r.bos_token_id if r.HasField("bos_token_id") else None,
                                  r.max_context, r.has_chat_template)
        return self.meta

    async def tokenize(self, *, text: str | None = None, messages: list[tuple[str, str]] | None = None,
                       timeout: float | None = None, cache_key: str = "",
                       allow_special_tokens: bool = False) -> list[int]:
        """Ids of a text or a chat. With `cache_key` (a chat session) every call goes to the same
        replica (while the membership stays), whose prefix cache then tokenizes only the new part."""
        if messages is not None:
            item = tokenizer_pb2.TokenizeInput(chat=tokenizer_pb2.ChatMessages(
                messages=[common_pb2.ChatMessage(role=r, content=c) for r, c in messages],
                add_generation_prompt=True, cache_key=cache_key), allow_special_tokens=allow_special_tokens)
        else:
            item = tokenizer_pb2.TokenizeInput(text=text or "", add_special_tokens=True,
                                               allow_special_tokens=allow_special_tokens)
        replicas = self._replicas
        replica = replicas[zlib.crc32(cache_key.encode()) % len(replicas)] if cache_key else self._pick()
        if not replica.up:
            replica = self._pick()
        budget = min(filter(None, (timeout, self._timeout)))
        try:
            try:
                ids = await replica.batcher.tokenize(item, budget)
                replica.suspect = False
                return ids
            except TokenrelayError as exc:
                if exc.reason != Reason.UPSTREAM_UNAVAILABLE:
                    raise
                self._mark_down(replica)
                other = self._pick()
                if other is replica:
                    raise
                return await other.batcher.tokenize(item, budget)   # idempotent: once elsewhere
        except asyncio.TimeoutError:
            raise Reason.TOKENIZE_TIMEOUT.error("tokenization did not finish in time") from None

    def _pick(self) -> _Replica:
        """The next replica in turn that is up (any, when none is)."""
        replicas = self._replicas
        for _ in range(len(replicas)):
            self._turn = (self._turn + 1) % len(replicas)
            if replicas[self._turn].up:
                return replicas[self._turn]
        return replicas[self._turn % len(replicas)]

    def _mark_down(self, replica: _Replica) -> None:
        if replica.up:
            log.warning("tokenizer_unavailable", address=replica.address, for_s=TOKENIZER_DOWN_FOR)
        replica.down_until = time.monotonic() + TOKENIZER_DOWN_FOR
        replica.suspect = True

    def detokenizer(self, request_id: str) -> DetokSession:
        up = [r for r in self._replicas if not r.suspect] or self._replicas
        replica = min(up, key=lambda r: r.mux.open_requests)
        return DetokSession(replica.mux, request_id)

    async def close(self) -> None:
        for replica in self._retired:
            if replica.closer is not None:
                replica.closer.cancel()
        for replica in [*self._replicas, *self._retired]:
            await self._close_replica(replica)
        self._retired.clear()
