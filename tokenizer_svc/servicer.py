"""The Tokenizer gRPC servicer: protobuf <-> domain conversion only.

Errors are typed exceptions raised by the domain; the interceptor in services.grpc_util turns
them into status codes with a reason, so there is no try/except here.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import grpc

from services.proto.tokenrelay.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from services.tokenization.detok_stream import Converted, Detokenizer, OpenRequest, Output, StreamBatch, TokenBatch
from services.tokenization.encoder import ChatInput, EncodeInput, Encoder, TextInput
from services.wire import pack_ids

SERVICE_NAME = tokenizer_pb2.DESCRIPTOR.services_by_name["Tokenizer"].full_name


class TokenizerServicer(tokenizer_pb2_grpc.TokenizerServicer):
    def __init__(self, encoder: Encoder, detokenizer: Detokenizer) -> None:
        self._encoder = encoder
        self._detokenizer = detokenizer
        self._info = _info(encoder)

    async def Tokenize(self, request: tokenizer_pb2.TokenizeRequest,
                       context: grpc.aio.ServicerContext) -> tokenizer_pb2.TokenizeResponse:
        response: tokenizer_pb2.TokenizeResponse = await self._encoder.tokenize(
            [_input(item) for item in request.inputs],
            finish=_packed_response if request.packed_ids else _tokenize_response)
        return response

    async def Detokenize(self, request_iterator: AsyncIterator[tokenizer_pb2.DetokenizeRequest],
                         context: grpc.aio.ServicerContext) -> AsyncIterator[tokenizer_pb2.DetokenizeResponse]:
        # closing(): requests still open when the stream ends (or breaks) are dropped.
        with contextlib.closing(self._detokenizer.open_stream()) as stream:
            async for request in request_iterator:
                outputs = await self._detokenizer.apply(stream, _stream_batch(request))
                if outputs:
                    yield tokenizer_pb2.DetokenizeResponse(outputs=[_output(o) for o in outputs])

    async def Info(self, request: tokenizer_pb2.InfoRequest,
                   context: grpc.aio.ServicerContext) -> tokenizer_pb2.TokenizerInfo:
        return self._info


def _input(item: tokenizer_pb2.TokenizeInput) -> EncodeInput | None:
    kind = item.WhichOneof("input")
    if kind == "text":
        return TextInput(item.text, item.add_special_tokens, item.allow_special_tokens)
    if kind == "chat":
        messages = [{"role": m.role, "content": m.content} for m in item.chat.messages]
        return ChatInput(messages, item.chat.add_generation_prompt, item.chat.cache_key, item.allow_special_tokens)
    return None   # the encoder rejects it as EMPTY_PROMPT


def _tokenize_response(ids: list[list[int]]) -> tokenizer_pb2.TokenizeResponse:
    # Runs on the encoder's post thread: filling repeated fields costs ~22 ns per id.
    return tokenizer_pb2.TokenizeResponse(results=[tokenizer_pb2.TokenizeResult(ids=seq) for seq in ids])


def _packed_response(ids: list[list[int]]) -> tokenizer_pb2.TokenizeResponse:
    # ~4 ns per id, and serializing is a copy instead of a varint per id.
    return tokenizer_pb2.TokenizeResponse(results=[tokenizer_pb2.TokenizeResult(packed_ids=pack_ids(seq))
                                                   for seq in ids])


def _stream_batch(request: tokenizer_pb2.DetokenizeRequest) -> StreamBatch:
    # Items are converted when the domain reads them (in slices, off the loop for a big message);
    # prefix_ids and token_ids stay protobuf containers: the domain slices them.
    return StreamBatch(opens=Converted(request.open, _open), tokens=Converted(request.tokens, _tokens),
                       closes=Converted(request.close, _close), ids=sum(len(t.token_ids) for t in request.tokens))


def _open(o: tokenizer_pb2.DetokOpen) -> OpenRequest:
    return OpenRequest(o.request_id, tuple(o.stop), o.include_stop_str, o.skip_special_tokens, o.prefix_ids,
                       dict(o.trace_context))


def _tokens(t: tokenizer_pb2.DetokTokens) -> TokenBatch:
    return TokenBatch(t.request_id, t.token_ids, t.final)


def _close(c: tokenizer_pb2.DetokClose) -> str:
    return c.request_id


def _output(o: Output) -> tokenizer_pb2.DetokOutput:
    return tokenizer_pb2.DetokOutput(request_id=o.request_id, text=o.text, finished=o.finished,
                                     matched_stop=o.matched_stop, tokens_consumed=o.tokens_consumed,
                                     error=o.error)


def _info(encoder: Encoder) -> tokenizer_pb2.TokenizerInfo:
    tok = encoder.tokenizer
    return tokenizer_pb2.TokenizerInfo(
        name=tok.name, vocab_size=tok.vocab_size, eos_token_ids=list(tok.eos_token_ids),
        bos_token_id=tok.bos_token_id, max_context=tok.max_context,
        has_chat_template=encoder.template is not None, special_token_ids=sorted(tok.special_ids))
