"""Router-side Tokenize coalescing against a real tokenizer_svc over loopback gRPC."""

from __future__ import annotations

import asyncio

import pytest
from tokenizers import Tokenizer

from router_svc.tokenize_batch import TokenizeCoalescer
from services.errors import InvalidArgument
from services.grpc_util import insecure_channel
from services.proto.tokenrelay.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from tests.tiny_model import build_tokenizer
from tests.waiting import poll
from tokenizer_svc.app import TokenizerApp
from tokenizer_svc.config import TokenizerSettings


@pytest.fixture
async def tokenizer(tmp_path):
    build_tokenizer(tmp_path / "tok")
    app = TokenizerApp(TokenizerSettings(tokenizer=str(tmp_path / "tok"), port=0, max_input_bytes=200))
    await app.start()
    channel = insecure_channel(app.address)
    yield tokenizer_pb2_grpc.TokenizerStub(channel), Tokenizer.from_file(str(tmp_path / "tok" / "tokenizer.json"))
    await channel.close()
    await app.stop()


def _text(text: str) -> tokenizer_pb2.TokenizeInput:
    return tokenizer_pb2.TokenizeInput(text=text, add_special_tokens=True)


async def test_lone_request_goes_at_once_and_concurrent_ones_share_calls(tokenizer):
    stub, tok = tokenizer
    coalescer = TokenizeCoalescer(stub, timeout=10, max_calls=1)
    try:
        assert await coalescer.tokenize(_text("hello there"), 10) == tok.encode("hello there").ids
        assert (coalescer.calls_sent, coalescer.inputs_sent) == (1, 1)
        texts = [f"request number {i} says hi" for i in range(40)]
        results = await asyncio.gather(*(coalescer.tokenize(_text(t), 10) for t in texts))
        assert results == [tok.encode(t).ids for t in texts]
        # 40 requests arriving together: one call for the first, the rest batched behind it.
        assert coalescer.inputs_sent == 41 and coalescer.calls_sent <= 3
    finally:
        await coalescer.close()


async def test_one_bad_input_fails_only_its_own_request(tokenizer):
    stub, tok = tokenizer
    coalescer = TokenizeCoalescer(stub, timeout=10, max_calls=1)
    try:
        blocker = asyncio.create_task(coalescer.tokenize(_text("first"), 10))
        await poll(lambda: coalescer.calls_sent == 1, what="first call in flight")  # the rest queue behind it
        good = [coalescer.tokenize(_text(f"fine {i}"), 10) for i in range(5)]
        bad = coalescer.tokenize(_text("x" * 500), 10)  # above max_input_bytes=200
        results = await asyncio.gather(*good, bad, return_exceptions=True)
        assert results[:5] == [tok.encode(f"fine {i}").ids for i in range(5)]
        assert isinstance(results[5], InvalidArgument) and results[5].reason == "INPUT_TOO_LARGE"
        assert await blocker == tok.encode("first").ids
        # The six went as one call, which failed and was retried input by input.
        assert (coalescer.calls_sent, coalescer.inputs_sent) == (1 + 1 + 6, 1 + 6 + 6)
    finally:
        await coalescer.close()


async def test_waiting_requests_are_spread_over_free_call_slots(tokenizer):
    """40 requests arriving at an idle coalescer with 2 call slots go as 2 calls of 20, so the
    replica has one queued behind the one it encodes (one call of 40 left it idle in between)."""
    stub, tok = tokenizer
    coalescer = TokenizeCoalescer(stub, timeout=10, max_calls=2)
    try:
        texts = [f"request number {i} says hi" for i in range(40)]
        results = await asyncio.gather(*(coalescer.tokenize(_text(t), 10) for t in texts))
        assert results == [tok.encode(t).ids for t in texts]
        assert (coalescer.calls_sent, coalescer.inputs_sent) == (2, 40)
    finally:
        await coalescer.close()
