"""Router-side Tokenize coalescing against a real tokenizer_svc over loopback gRPC."""

from __future__ import annotations

import asyncio

import pytest
from tokenizers import Tokenizer

from router_svc.tokenize_batch import TokenizeCoalescer
from services.channels import open_channel
from services.errors import InvalidArgument
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
    channel = open_channel(app.address)
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


class _Recording:
    """The real stub, with each Tokenize call's input count recorded as it is sent."""

    def __init__(self, stub):
        self.stub, self.sizes = stub, []

    def Tokenize(self, request, **kwargs):   # the stub's method name
        self.sizes.append(len(request.inputs))
        return self.stub.Tokenize(request, **kwargs)


async def test_waiting_requests_are_spread_over_two_calls(tokenizer):
    """40 requests arriving at an idle coalescer go as 2 calls of 20 (not 4 of 10 although 4
    slots are free), so the replica has one queued behind the one it encodes (one call of 40
    left it idle in between) and the calls stay big."""
    stub, tok = tokenizer
    recording = _Recording(stub)
    coalescer = TokenizeCoalescer(recording, timeout=10, max_calls=4)
    try:
        texts = [f"request number {i} says hi" for i in range(40)]
        results = await asyncio.gather(*(coalescer.tokenize(_text(t), 10) for t in texts))
        assert results == [tok.encode(t).ids for t in texts]
        assert recording.sizes == [20, 20]
    finally:
        await coalescer.close()


async def test_more_calls_only_when_more_than_two_full_calls_wait(tokenizer):
    """200 waiting with max_batch 32: every free slot gets a full call (the replica merges
    queued calls into big batches); what is left goes as calls come back."""
    stub, tok = tokenizer
    recording = _Recording(stub)
    coalescer = TokenizeCoalescer(recording, timeout=10, max_batch=32, max_calls=4)
    try:
        texts = [f"request {i}" for i in range(200)]
        results = await asyncio.gather(*(coalescer.tokenize(_text(t), 10) for t in texts))
        assert results == [tok.encode(t).ids for t in texts]
        assert recording.sizes[:4] == [32, 32, 32, 32] and sum(recording.sizes) == 200
        assert max(recording.sizes) == 32
    finally:
        await coalescer.close()


async def test_byte_budget_limits_what_is_in_flight(tokenizer):
    """With room for about 3 inputs in flight, 12 waiting go 3 at a time at most; an input
    larger than the whole budget still goes when nothing else is in flight."""
    stub, tok = tokenizer
    recording = _Recording(stub)
    item_bytes = _text("x" * 40).ByteSize()
    coalescer = TokenizeCoalescer(recording, timeout=10, max_calls=4, max_bytes=3 * item_bytes)
    try:
        texts = [f"{i:02d}" + "x" * 38 for i in range(12)]
        results = await asyncio.gather(*(coalescer.tokenize(_text(t), 10) for t in texts))
        assert results == [tok.encode(t).ids for t in texts]
        assert sum(recording.sizes) == 12 and max(recording.sizes) <= 3
        assert coalescer._bytes_in_flight == 0
        big = "y" * 150   # above the budget, below the tokenizer's max_input_bytes
        assert await coalescer.tokenize(_text(big), 10) == tok.encode(big).ids
    finally:
        await coalescer.close()
