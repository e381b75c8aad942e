"""Inference servicer: protobuf ↔ domain conversion only (errors map in the interceptor).

A request that does not decode (corrupt wire format, invalid UTF-8 in a string), unary or inside
the Chat stream, never reaches this module: `services.grpc_util.ErrorInterceptor` answers it with
INVALID_ARGUMENT / MALFORMED_MESSAGE.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import TypeVar

import grpc

from services.proto.tokenrelay.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from services.wire import FINISH_CODES

from .chat import ChatCancel, ChatIn, ChatStart, ChatStarted, ChatTurn, Sessions, run_chat
from .metrics import STREAM_CALLS
from .pipeline import Router
from .stream_call import StreamIn, StreamSubmit, run_stream
from .tenants import Authenticator, Tenant, api_key_from_metadata
from .types import Accepted, Delta, Done, Event, GenerateInput, Migrated, Sampling, TurnError

_Response = TypeVar("_Response", inference_pb2.GenerateResponse, inference_pb2.ChatResponse,
                    inference_pb2.StreamEvent)


def sampling_from_pb(s: common_pb2.SamplingParams) -> Sampling:
    return Sampling(max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                    seed=s.seed if s.HasField("seed") else None, stop=list(s.stop),
                    stop_token_ids=list(s.stop_token_ids), ignore_eos=s.ignore_eos,
                    include_stop_str=s.include_stop_str)


def _messages(msgs: object) -> list[tuple[str, str]]:
    return [(m.role, m.content) for m in msgs]  # type: ignore[attr-defined]


def generate_input_from_pb(r: inference_pb2.GenerateRequest) -> GenerateInput:
    which = r.WhichOneof("input")
    return GenerateInput(
        sampling=sampling_from_pb(r.sampling),
        prompt=r.prompt if which == "prompt" else None,
        messages=_messages(r.messages.messages) if which == "messages" else None,
        token_ids=list(r.token_ids.ids) if which == "token_ids" else None,
        priority=int(r.priority), session_id=r.session_id, return_token_ids=r.return_token_ids,
        request_id=r.request_id, model=r.model, min_delta_tokens=r.min_delta_tokens,
        min_delta_interval_ms=r.min_delta_interval_ms)


def _delta_into(response: _Response, event: Delta) -> _Response:
    """Fill the response's `delta` in place: the per-token hot path (a third of building a
    `Delta` and passing it, and the event dict, to the response's constructor)."""
    delta = response.delta
    if event.text:
        delta.text = event.text
    if event.token_ids:
        delta.token_ids.extend(event.token_ids)
    if not event.text and not event.token_ids:
        delta.SetInParent()
    return response


def event_to_pb(event: Event) -> dict[str, object]:
    """The oneof field name and value shared by GenerateResponse and ChatResponse."""
    if isinstance(event, Delta):
        return {"delta": inference_pb2.Delta(text=event.text, token_ids=event.token_ids)}
    if isinstance(event, Accepted):
        return {"accepted": inference_pb2.Accepted(request_id=event.request_id,
                                                   prompt_tokens=event.prompt_tokens,
                                                   queue_position=event.queue_position)}
    if isinstance(event, Migrated):
        return {"migrated": inference_pb2.Migrated(migrations=event.migrations, tokens_so_far=event.tokens_so_far,
                                                   reason=event.reason)}
    assert isinstance(event, Done)
    u, t = event.usage, event.timings
    return {"done": inference_pb2.Done(
        finish_reason=FINISH_CODES[event.finish_reason], stop_reason=event.stop_reason,
        usage=common_pb2.Usage(prompt_tokens=u.prompt_tokens, cached_tokens=u.cached_tokens,
                               completion_tokens=u.completion_tokens),
        timings=common_pb2.Timings(queue_seconds=t.queue_seconds, ttft_seconds=t.ttft_seconds,
                                   total_seconds=t.total_seconds, tokenize_seconds=t.tokenize_seconds,
                                   decode_seconds=t.decode_seconds))}


def turn_error_to_pb(e: TurnError) -> inference_pb2.TurnError:
    retry_ms = int(e.retry_after * 1000) if e.retry_after else 0
    return inference_pb2.TurnError(code=e.code, reason=e.reason, message=e.message, retry_after_ms=retry_ms,
                                   request_id=e.request_id)


async def _chat_in(requests: AsyncIterator[inference_pb2.ChatRequest]) -> AsyncIterator[ChatIn]:
    async for r in requests:
        which = r.WhichOneof("event")
        if which == "start":
            yield ChatStart(r.start.session_id, _messages(r.start.system), int(r.start.priority),
                            r.start.return_token_ids)
        elif which == "turn":
            yield ChatTurn(_messages(r.turn.messages), sampling_from_pb(r.turn.sampling),
                           r.turn.min_delta_tokens, r.turn.min_delta_interval_ms)
        elif which == "cancel":
            yield ChatCancel()


async def _stream_in(requests: AsyncIterator[inference_pb2.StreamRequest]) -> AsyncIterator[StreamIn]:
    async for r in requests:
        yield StreamIn(time.monotonic(),
                       [StreamSubmit(generate_input_from_pb(s.request), s.timeout_ms / 1000 if s.timeout_ms else None)
                        for s in r.submit], list(r.cancel))


def _stream_response(batch: list[tuple[str, Event | TurnError]]) -> inference_pb2.StreamResponse:
    response = inference_pb2.StreamResponse()
    add = response.events.add
    for request_id, event in batch:
        if type(event) is Delta:
            _delta_into(add(request_id=request_id), event)
        elif isinstance(event, TurnError):
            add(request_id=request_id, error=turn_error_to_pb(event))
        else:
            add(request_id=request_id, **event_to_pb(event))  # type: ignore[arg-type]
    return response


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    def __init__(self, router: Router, tenants: Authenticator) -> None:
        self.router = router
        self.tenants = tenants
        self.sessions = Sessions(router.options.bounds)

    def _tenant(self, context: grpc.aio.ServicerContext) -> Tenant:
        return self.tenants.authenticate(api_key_from_metadata(context.invocation_metadata()))

    async def Generate(self, request: inference_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[inference_pb2.GenerateResponse]:
        t_arrival = time.monotonic()
        tenant = self._tenant(context)
        remaining = context.time_remaining()
        deadline = t_arrival + remaining if remaining is not None else None
        response = inference_pb2.GenerateResponse
        async for event in self.router.generate(tenant, generate_input_from_pb(request), deadline, t_arrival):
            if type(event) is Delta:
                yield _delta_into(response(), event)
            else:
                yield response(**event_to_pb(event))  # type: ignore[arg-type]

    async def Chat(self, request_iterator: AsyncIterator[inference_pb2.ChatRequest],
                   context: grpc.aio.ServicerContext) -> AsyncIterator[inference_pb2.ChatResponse]:
        tenant = self._tenant(context)
        async for event in run_chat(self.router, self.sessions, tenant, _chat_in(request_iterator)):
            if isinstance(event, ChatStarted):
                yield inference_pb2.ChatResponse(started=inference_pb2.ChatStarted(session_id=event.session_id))
            elif type(event) is Delta:
                yield _delta_into(inference_pb2.ChatResponse(), event)
            elif isinstance(event, TurnError):
                yield inference_pb2.ChatResponse(turn_error=turn_error_to_pb(event))
            else:
                yield inference_pb2.ChatResponse(**event_to_pb(event))  # type: ignore[arg-type]

    async def Stream(self, request_iterator: AsyncIterator[inference_pb2.StreamRequest],
                     context: grpc.aio.ServicerContext) -> AsyncIterator[inference_pb2.StreamResponse]:
        tenant = self._tenant(context)
        remaining = context.time_remaining()
        deadline = time.monotonic() + remaining if remaining is not None else None
        calls = STREAM_CALLS.labels(tenant.name)
        calls.inc()
        try:
            async for batch in run_stream(self.router, tenant, _stream_in(request_iterator), call_deadline=deadline,
                                          max_requests=self.router.options.bounds.max_stream_requests):
                yield _stream_response(batch)
        finally:
            calls.dec()

    async def Cancel(self, request: inference_pb2.CancelRequest,
                     context: grpc.aio.ServicerContext) -> inference_pb2.CancelResponse:
        tenant = self._tenant(context)
        return inference_pb2.CancelResponse(cancelled=await self.router.cancel(tenant, request.request_id))


def add_to_server(servicer: InferenceServicer, server: grpc.aio.Server) -> None:
    inference_pb2_grpc.add_InferenceServicer_to_server(servicer, server)
