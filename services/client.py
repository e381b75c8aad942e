"""Typed asyncio client for tokenrelay's Inference API (used by the CLI, the tests and services).

    async with Client("127.0.0.1:50051", api_key="...") as client:
        async for event in client.stream("Once upon a time", max_tokens=64):
            if isinstance(event, TextDelta):
                print(event.text, end="")
        result = await client.generate("Hello", max_tokens=16)      # collected Completion
        async with client.chat(system="Be brief.") as chat:
            reply = await chat.say("Hi!", max_tokens=32)
        async with client.open_stream() as many:      # many requests on one open call
            results = await asyncio.gather(*(many.generate(p, max_tokens=16) for p in prompts))

Every failure is raised as a `services.errors.TokenrelayError` subclass carrying the server's
machine-readable reason (e.g. `ResourceExhausted` with reason TENANT_CONCURRENCY_LIMIT).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from services.channels import open_channel
from services.errors import (  # re-exported: callers catch these
    Cancelled,
    DeadlineExceeded,
    InvalidArgument,
    PermissionDenied,
    Reason,
    ResourceExhausted,
    TokenrelayError,
    Unauthenticated,
    Unavailable,
    error_for,
    from_rpc_error,
)
from services.mux import MuxClient, StreamBroken
from services.proto.tokenrelay.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from services.security import PLAINTEXT, SecuritySettings
from services.wire import FINISH_NAMES

__all__ = ["Accepted", "Cancelled", "ChatSession", "Client", "Completion", "DeadlineExceeded", "Finished",
           "InvalidArgument", "Migrated", "PermissionDenied", "Reason", "RequestStream", "ResourceExhausted",
           "Sampling", "TextDelta", "TokenrelayError", "Unauthenticated", "Unavailable", "collect"]
PRIORITIES = {"": common_pb2.PRIORITY_UNSPECIFIED, "low": common_pb2.PRIORITY_LOW,
              "normal": common_pb2.PRIORITY_NORMAL, "high": common_pb2.PRIORITY_HIGH}


@dataclass(frozen=True)
class Accepted:
    request_id: str
    prompt_tokens: int
    queue_position: int


@dataclass(frozen=True)
class TextDelta:
    text: str
    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class Finished:
    finish_reason: str
    stop_reason: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    queue_seconds: float
    ttft_seconds: float
    total_seconds: float
    tokenize_seconds: float
    decode_seconds: float


@dataclass(frozen=True)
class Migrated:
    """The request moved to another engine replica mid-stream; the stream goes on."""

    migrations: int
    tokens_so_far: int
    reason: str


Event = Accepted | TextDelta | Finished | Migrated


@dataclass
class Completion:
    request_id: str
    text: str
    token_ids: list[int]
    finished: Finished
    deltas: int = 0
    migrations: int = 0


@dataclass
class Sampling:
    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 0.0
    top_k: int = 0
    seed: int | None = None
    stop: Sequence[str] = field(default_factory=tuple)
    stop_token_ids: Sequence[int] = field(default_factory=tuple)
    ignore_eos: bool = False
    include_stop_str: bool = False

    def to_pb(self) -> common_pb2.SamplingParams:
        pb = common_pb2.SamplingParams(
            max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            stop=list(self.stop), stop_token_ids=list(self.stop_token_ids), ignore_eos=self.ignore_eos,
            include_stop_str=self.include_stop_str)
        if self.seed is not None:
            pb.seed = self.seed
        return pb


def _event(msg: Any) -> Event | None:
    which = msg.WhichOneof("event")
    if which == "accepted":
        a = msg.accepted
        return Accepted(a.request_id, a.prompt_tokens, a.queue_position)
    if which == "delta":
        return TextDelta(msg.delta.text, tuple(msg.delta.token_ids))
    if which == "done":
        d, u, t = msg.done, msg.done.usage, msg.done.timings
        return Finished(FINISH_NAMES.get(d.finish_reason, "unknown"), d.stop_reason, u.prompt_tokens,
                        u.cached_tokens, u.completion_tokens, t.queue_seconds, t.ttft_seconds,
                        t.total_seconds, t.tokenize_seconds, t.decode_seconds)
    if which == "migrated":
        m = msg.migrated
        return Migrated(m.migrations, m.tokens_so_far, m.reason)
    return None


async def collect(events: AsyncIterator[Event]) -> Completion:
    request_id, deltas, migrations = "", 0, 0
    text: list[str] = []
    ids: list[int] = []
    async for event in events:
        if isinstance(event, Accepted):
            request_id = event.request_id
        elif isinstance(event, Migrated):
            migrations = event.migrations
        elif isinstance(event, TextDelta):
            text.append(event.text)
            ids.extend(event.token_ids)
            deltas += 1
        else:
            return Completion(request_id, "".join(text), ids, event, deltas, migrations)
    raise Reason.INCOMPLETE_STREAM.error("stream ended without `done`")


def _messages(messages: Sequence[tuple[str, str]] | Sequence[dict[str, str]]) -> list[common_pb2.ChatMessage]:
    out = []
    for m in messages:
        role, content = (m["role"], m["content"]) if isinstance(m, dict) else m
        out.append(common_pb2.ChatMessage(role=role, content=content))
    return out


def _request(prompt: str | None, messages: Any, token_ids: Sequence[int] | None, sampling: Sampling,
             priority: str, session_id: str, request_id: str, return_token_ids: bool, min_delta_tokens: int = 0,
             min_delta_interval_ms: int = 0) -> inference_pb2.GenerateRequest:
    given = sum(x is not None for x in (prompt, messages, token_ids))
    if given != 1:
        raise Reason.MISSING_INPUT.error("pass exactly one of prompt, messages, token_ids")
    req = inference_pb2.GenerateRequest(sampling=sampling.to_pb(), priority=PRIORITIES[priority],
                                        session_id=session_id, request_id=request_id,
                                        return_token_ids=return_token_ids, min_delta_tokens=min_delta_tokens,
                                        min_delta_interval_ms=min_delta_interval_ms)
    if prompt is not None:
        req.prompt = prompt
    elif messages is not None:
        req.messages.messages.extend(_messages(messages))
    else:
        req.token_ids.ids.extend(token_ids or [])
    return req


def _raise_error(e: inference_pb2.TurnError) -> None:
    raise error_for(e.reason, e.message, code=getattr(grpc.StatusCode, e.code, None),
                    retry_after=e.retry_after_ms / 1000 if e.retry_after_ms else None)


class Client:
    def __init__(self, address: str, api_key: str, *, timeout: float | None = None,
                 security: SecuritySettings = PLAINTEXT) -> None:
        self.address = address
        self._metadata = (("authorization", f"Bearer {api_key}"),)
        self._timeout = timeout
        self._channel = open_channel(address, security)
        self._stub = inference_pb2_grpc.InferenceStub(self._channel)

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def stream(self, prompt: str | None = None, *, messages: Any = None,
                     token_ids: Sequence[int] | None = None, priority: str = "", session_id: str = "",
                     request_id: str = "", return_token_ids: bool = False, timeout: float | None = None,
                     min_delta_tokens: int = 0, min_delta_interval_ms: int = 0,
                     **sampling: Any) -> AsyncIterator[Event]:
        """Stream events: `Accepted`, then `TextDelta`s, then `Finished`. Breaking out cancels.
        `min_delta_tokens` / `min_delta_interval_ms`: coarser deltas (service-to-service callers)."""
        req = _request(prompt, messages, token_ids, Sampling(**sampling), priority, session_id,
                       request_id, return_token_ids, min_delta_tokens, min_delta_interval_ms)
        call = self._stub.Generate(req, metadata=self._metadata, timeout=timeout or self._timeout)
        try:
            async for msg in call:
                event = _event(msg)
                if event is not None:
                    yield event
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from None
        finally:
            call.cancel()

    async def generate(self, prompt: str | None = None, **kwargs: Any) -> Completion:
        return await collect(self.stream(prompt, **kwargs))

    async def cancel(self, request_id: str) -> bool:
        try:
            resp = await self._stub.Cancel(inference_pb2.CancelRequest(request_id=request_id),
                                           metadata=self._metadata, timeout=10)
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from None
        return resp.cancelled

    def open_stream(self, *, timeout: float | None = None) -> RequestStream:
        """Many requests on one open `Stream` call (`async with client.open_stream() as s:`): no call
        set up per request, and the router sends many requests' events per message."""
        return RequestStream(self._stub, self._metadata, timeout or self._timeout)

    def chat(self, *, session_id: str = "", system: str | None = None, priority: str = "",
             return_token_ids: bool = False) -> ChatSession:
        return ChatSession(self._stub, self._metadata, session_id, system, PRIORITIES[priority], return_token_ids)


class ChatSession:
    """A bidirectional chat stream. Use as `async with client.chat() as chat:`."""

    def __init__(self, stub: inference_pb2_grpc.InferenceStub, metadata: Any, session_id: str,
                 system: str | None, priority: common_pb2.Priority, return_token_ids: bool = False) -> None:
        self._stub = stub
        self._metadata = metadata
        self._outbox: asyncio.Queue[inference_pb2.ChatRequest | None] = asyncio.Queue()
        start = inference_pb2.ChatStart(session_id=session_id, priority=priority,
                                        return_token_ids=return_token_ids)
        if system:
            start.system.append(common_pb2.ChatMessage(role="system", content=system))
        self._outbox.put_nowait(inference_pb2.ChatRequest(start=start))
        self._call: Any = None
        self.session_id = ""

    async def _requests(self) -> AsyncIterator[inference_pb2.ChatRequest]:
        while (item := await self._outbox.get()) is not None:
            yield item

    async def _next(self) -> Any:
        try:
            msg = await self._call.read()
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from None
        if msg is grpc.aio.EOF:
            raise Reason.STREAM_CLOSED.error("chat stream closed")
        return msg

    async def __aenter__(self) -> ChatSession:
        self._call = self._stub.Chat(self._requests(), metadata=self._metadata)
        msg = await self._next()
        self.session_id = msg.started.session_id
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._outbox.put_nowait(None)
        if self._call is not None:
            self._call.cancel()

    async def send(self, content: str, *, role: str = "user", min_delta_tokens: int = 0,
                   min_delta_interval_ms: int = 0, **sampling: Any) -> AsyncIterator[Event]:
        """Send one turn and stream its events (`Accepted`, `TextDelta`s, `Finished`). A turn the
        router fails or refuses raises its typed error; the session stays usable."""
        self._outbox.put_nowait(inference_pb2.ChatRequest(turn=inference_pb2.ChatTurn(
            messages=[common_pb2.ChatMessage(role=role, content=content)],
            sampling=Sampling(**sampling).to_pb(), min_delta_tokens=min_delta_tokens,
            min_delta_interval_ms=min_delta_interval_ms)))
        while True:
            msg = await self._next()
            if msg.WhichOneof("event") == "turn_error":
                _raise_error(msg.turn_error)
            event = _event(msg)
            if event is None:
                continue
            yield event
            if isinstance(event, Finished):
                return

    async def say(self, content: str, **sampling: Any) -> Completion:
        return await collect(self.send(content, **sampling))

    def cancel_turn(self) -> None:
        self._outbox.put_nowait(inference_pb2.ChatRequest(cancel=inference_pb2.ChatCancel()))



class _TypedCall:
    """The Stream call as `MuxClient` reads it, with its end typed as a client sees it: the router's
    status (`from_rpc_error`), or STREAM_CLOSED when the router ended the call."""

    def __init__(self, call: Any) -> None:
        self._call = call

    def cancel(self) -> bool:
        return bool(self._call.cancel())

    def __aiter__(self) -> AsyncIterator[inference_pb2.StreamResponse]:
        return self._responses()

    async def _responses(self) -> AsyncIterator[inference_pb2.StreamResponse]:
        try:
            async for response in self._call:
                yield response
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from None
        raise Reason.STREAM_CLOSED.error("the Stream call ended")


def _stream_request(pending: dict[str, list[Any]]) -> inference_pb2.StreamRequest:
    return inference_pb2.StreamRequest(submit=pending.get("submit", []), cancel=pending.get("cancel", []))


def _stream_events(response: inference_pb2.StreamResponse) -> list[tuple[str, Any]]:
    return [(event.request_id, event) for event in response.events]


class RequestStream:
    """Requests multiplexed on one `Stream` call (`services.mux.MuxClient`: what is posted while a
    write is out goes in the next message; events fan out by request id). `stream()` / `generate()`
    may run from many tasks at once; breaking out of `stream()` cancels that request; leaving the
    `async with` ends the call (what is still in flight is cancelled). A request's failure raises its
    typed error there; a call that ends (the router gone, a deadline) raises in every request still
    waiting, and in every request sent after it."""

    def __init__(self, stub: inference_pb2_grpc.InferenceStub, metadata: Any, timeout: float | None) -> None:
        self._failure: TokenrelayError | None = None
        self._live: set[str] = set()
        self._mux: MuxClient[inference_pb2.StreamEvent] = MuxClient(
            "Stream", lambda requests: _TypedCall(stub.Stream(requests, metadata=metadata, timeout=timeout)),
            _stream_request, _stream_events, on_broken=self._broken)

    def _broken(self, error: TokenrelayError) -> None:
        self._failure = self._failure or error

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._failure = self._failure or Reason.STREAM_CLOSED.error("the Stream call was closed")
        await self._mux.close()

    async def stream(self, prompt: str | None = None, *, messages: Any = None,
                     token_ids: Sequence[int] | None = None, priority: str = "", session_id: str = "",
                     request_id: str = "", return_token_ids: bool = False, timeout: float | None = None,
                     min_delta_tokens: int = 0, min_delta_interval_ms: int = 0,
                     **sampling: Any) -> AsyncIterator[Event]:
        """As `Client.stream`, on this call; `timeout` is this request's own deadline."""
        if self._failure is not None:
            raise self._failure
        rid = request_id or uuid.uuid4().hex
        if rid in self._live:
            raise Reason.DUPLICATE_REQUEST_ID.error("request_id already in flight on this Stream call")
        req = _request(prompt, messages, token_ids, Sampling(**sampling), priority, session_id, rid,
                       return_token_ids, min_delta_tokens, min_delta_interval_ms)
        inbox = self._mux.open(rid)
        self._live.add(rid)
        self._mux.post("submit", inference_pb2.StreamSubmit(
            request=req, timeout_ms=max(1, round(timeout * 1000)) if timeout else 0))
        finished = False
        try:
            while True:
                for msg in await inbox.get_ready():
                    if isinstance(msg, StreamBroken):
                        raise self._failure or msg.error
                    if msg.WhichOneof("event") == "error":
                        finished = True
                        _raise_error(msg.error)
                    event = _event(msg)
                    if event is not None:
                        yield event
                    if isinstance(event, Finished):
                        finished = True
                        return
        finally:
            self._live.discard(rid)
            if self._mux.release(rid) and not finished and self._failure is None:
                self._mux.post("cancel", rid)

    async def generate(self, prompt: str | None = None, **kwargs: Any) -> Completion:
        return await collect(self.stream(prompt, **kwargs))
