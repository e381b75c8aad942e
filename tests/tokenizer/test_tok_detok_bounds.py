"""Detokenize: bounded work per message (issue 15: one message of 10,001 opens held the loop 0.74 s).

A message over the bounds ends the stream with INVALID_ARGUMENT/BATCH_TOO_LARGE; a big message
within them runs in slices off the loop (the loop's own CPU time between two 1 ms ticks stays a
few ms, where it was the whole message's before), and slicing changes no output.
"""

from __future__ import annotations

import asyncio
import pathlib
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from services.errors import REASON_KEY, Reason
from services.proto.tokenrelay.v1 import tokenizer_pb2 as pb
from services.proto.tokenrelay.v1 import tokenizer_pb2_grpc
from services.tokenization.detok_stream import Detokenizer, OpenRequest, StreamBatch, TokenBatch
from services.tokenization.loader import LoadedTokenizer, TokenizerFiles, load_tokenizer
from tokenizer_svc.app import TokenizerApp
from tokenizer_svc.config import TokenizerSettings
from tokenrelay_tools.cli.byte_tokenizer import ensure_byte_tokenizer


@pytest.fixture(scope="module")
def byte_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return ensure_byte_tokenizer(tmp_path_factory.mktemp("cache"))


async def _app(directory: pathlib.Path, **options: Any) -> TokenizerApp:
    app = TokenizerApp(TokenizerSettings(tokenizer=str(directory), port=0, workers=1, shutdown_grace=0.1,
                                         **options))
    await app.start()
    return app


@pytest.fixture
async def small_bounds(byte_dir: pathlib.Path) -> AsyncIterator[tokenizer_pb2_grpc.TokenizerStub]:
    app = await _app(byte_dir, max_message_opens=100, max_message_tokens=1000)
    try:
        async with grpc.aio.insecure_channel(app.address) as channel:
            yield tokenizer_pb2_grpc.TokenizerStub(channel)
    finally:
        await app.stop()


@pytest.mark.parametrize("message", [
    pb.DetokenizeRequest(open=[pb.DetokOpen(request_id=f"r{i}") for i in range(101)]),
    pb.DetokenizeRequest(open=[pb.DetokOpen(request_id="r")],
                         tokens=[pb.DetokTokens(request_id="r", token_ids=[65] * 600),
                                 pb.DetokTokens(request_id="r", token_ids=[66] * 401)])],
    ids=["opens", "token-ids"])
async def test_a_message_over_the_bounds_ends_the_stream(small_bounds: tokenizer_pb2_grpc.TokenizerStub,
                                                         message: pb.DetokenizeRequest) -> None:
    call = small_bounds.Detokenize(iter([message]))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in call:
            pass
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert dict(err.value.trailing_metadata() or ()).get(REASON_KEY) == Reason.BATCH_TOO_LARGE
    assert "at most" in (err.value.details() or "")
    # At the bound it is served.
    at_bound = pb.DetokenizeRequest(open=[pb.DetokOpen(request_id="a")],
                                    tokens=[pb.DetokTokens(request_id="a", token_ids=[65] * 1000, final=True)])
    out = [o async for r in small_bounds.Detokenize(iter([at_bound])) for o in r.outputs]
    assert "".join(o.text for o in out) == "A" * 1000 and out[-1].finished


async def test_a_big_message_does_not_hold_the_loop(byte_dir: pathlib.Path) -> None:
    """10,000 opens (the default bound) in one message, sent from another thread: the event loop
    never spends more than a few ms of its own CPU between two ticks (it spent the whole message's
    ~0.1-0.7 s before), and a small request on another stream is answered meanwhile."""
    app = await _app(byte_dir)
    big = pb.DetokenizeRequest(open=[pb.DetokOpen(request_id=f"r{i}", stop=["zz"]) for i in range(10_000)])
    result: dict[str, Any] = {}

    def send() -> None:
        with grpc.insecure_channel(app.address) as channel:
            for _ in tokenizer_pb2_grpc.TokenizerStub(channel).Detokenize(iter([big])):
                pass
        result["done"] = time.perf_counter()

    gaps: list[float] = []
    latencies: list[float] = []
    try:
        async with grpc.aio.insecure_channel(app.address) as channel:
            stub = tokenizer_pb2_grpc.TokenizerStub(channel)
            small = asyncio.Queue[pb.DetokenizeRequest]()

            async def outbound() -> AsyncIterator[pb.DetokenizeRequest]:
                while (item := await small.get()) is not None:
                    yield item
            small_call = stub.Detokenize(outbound())
            await small.put(pb.DetokenizeRequest(open=[pb.DetokOpen(request_id="s")]))
            sender = threading.Thread(target=send)
            last = time.thread_time()
            sender.start()
            n = 0
            while sender.is_alive() or "done" not in result:
                await asyncio.sleep(0.001)
                now = time.thread_time()   # the loop thread's own CPU: not inflated by a busy machine
                gaps.append(now - last)
                n += 1
                if n % 20 == 0:   # a one-token request on the other stream, every ~20 ticks
                    sent = time.perf_counter()
                    await small.put(pb.DetokenizeRequest(tokens=[pb.DetokTokens(request_id="s", token_ids=[65])]))
                    await small_call.read()
                    latencies.append(time.perf_counter() - sent)
                last = time.thread_time()
            sender.join()
            small_call.cancel()
    finally:
        await app.stop()
    print(f"loop CPU between ticks: max {max(gaps) * 1e3:.1f} ms; small request latency: "
          f"max {max(latencies, default=0) * 1e3:.1f} ms over {len(latencies)}")
    assert max(gaps) < 0.015
    assert latencies


def _loaded(byte_dir: pathlib.Path) -> LoadedTokenizer:
    return load_tokenizer(TokenizerFiles.discover(byte_dir))


async def test_slicing_changes_no_output(byte_dir: pathlib.Path) -> None:
    """The same batches applied whole and in slices of 1, 3 and 7 units give the same outputs
    (deltas merged per request, a stop string found across a cut, a final flush, an error)."""
    tok = _loaded(byte_dir)
    text = list(b"hello world, stop here and more")
    batches = [
        StreamBatch(opens=[OpenRequest("a", stop=("stop",)), OpenRequest("b"), OpenRequest("a")],
                    tokens=[TokenBatch("a", text[:9]), TokenBatch("b", text[:20]), TokenBatch("a", text[9:]),
                            TokenBatch("x", [65])]),
        StreamBatch(tokens=[TokenBatch("b", text[20:], final=True), TokenBatch("a", [66])], closes=["b"]),
        StreamBatch(opens=[OpenRequest("c")], tokens=[TokenBatch("c", [1, 2, 10**6])]),
    ]

    async def run(slice_tokens: int) -> list[list[tuple[Any, ...]]]:
        detok = Detokenizer(tok, workers=1, inline_tokens=0 if slice_tokens else 10**9, slice_tokens=slice_tokens)
        await detok.start()
        stream = detok.open_stream()
        try:
            return [[(o.request_id, o.text, o.finished, o.matched_stop, o.tokens_consumed, o.error)
                     for o in await detok.apply(stream, b)] for b in batches]
        finally:
            stream.close()
            await detok.close()

    whole = await run(0)
    assert whole[0][-1][0] == "x" and whole[2][0][-1] == Reason.INVALID_TOKEN_ID
    assert any(o[3] == "stop" for o in whole[0])
    for slice_tokens in (1, 3, 7):
        assert await run(slice_tokens) == whole, slice_tokens
