"""The Tokenizer service over real gRPC on an ephemeral port (in-process server)."""

from __future__ import annotations

import asyncio
import contextlib
import pathlib
import random
import threading
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tok_artefacts import SAMPLES, TEXT, build_bytelevel

from services.channels import open_channel
from services.errors import from_rpc_error
from services.proto.tokenrelay.v1 import common_pb2, tokenizer_pb2, tokenizer_pb2_grpc
from services.wire import unpack_ids
from tokenizer_svc.app import TokenizerApp
from tokenizer_svc.config import TokenizerSettings

pb = tokenizer_pb2


@contextlib.asynccontextmanager
async def running(directory: pathlib.Path, **overrides: Any) -> AsyncIterator[tuple[TokenizerApp, Any]]:
    options: dict[str, Any] = {"workers": 2, "shutdown_grace": 0.5, **overrides}
    settings = TokenizerSettings(tokenizer=str(directory), port=0, **options)
    app = TokenizerApp(settings)
    await app.start()
    try:
        async with open_channel(app.address) as channel:
            yield app, tokenizer_pb2_grpc.TokenizerStub(channel)
    finally:
        await app.stop()


def text_input(text: str, special: bool = True) -> pb.TokenizeInput:
    return pb.TokenizeInput(text=text, add_special_tokens=special)


def chat_input(messages: Sequence[tuple[str, str]], gen: bool = True) -> pb.TokenizeInput:
    return pb.TokenizeInput(chat=pb.ChatMessages(
        messages=[common_pb2.ChatMessage(role=r, content=c) for r, c in messages], add_generation_prompt=gen))


async def expect_error(call: Any, code: grpc.StatusCode, reason: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    assert info.value.code() == code
    assert from_rpc_error(info.value).reason == reason


async def test_info_and_health(tiny_dirs: dict[str, pathlib.Path]) -> None:
    async with running(tiny_dirs["tiny-sentencepiece"]) as (app, stub):
        info = await stub.Info(pb.InfoRequest())
        tok = app.encoder.tokenizer  # type: ignore[union-attr]
        assert info.name == "sentencepiece"
        assert info.vocab_size == tok.vocab_size
        assert list(info.eos_token_ids) == [2, 258]
        assert info.HasField("bos_token_id") and info.bos_token_id == 1
        assert info.max_context == 4096 and info.has_chat_template
        assert list(info.special_token_ids) == [0, 1, 2]
        async with open_channel(app.address) as channel:
            health = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="tokenrelay.v1.Tokenizer"))
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    async with running(tiny_dirs["tiny-bytelevel"]) as (_, stub):
        info = await stub.Info(pb.InfoRequest())
        assert not info.HasField("bos_token_id")


async def test_batched_tokenize_matches_the_tokenizer(tiny_dirs: dict[str, pathlib.Path]) -> None:
    async with running(tiny_dirs["tiny-sentencepiece"]) as (app, stub):
        raw = app.encoder.tokenizer.tokenizer  # type: ignore[union-attr]
        chat = [("system", "Be brief."), ("user", "Hi 👋"), ("assistant", "Hello"), ("user", "中文?")]
        resp = await stub.Tokenize(pb.TokenizeRequest(inputs=[
            text_input(TEXT), text_input(SAMPLES[3], special=False), text_input(""), chat_input(chat, False)]))
        ids = [list(r.ids) for r in resp.results]
        assert ids[0] == raw.encode(TEXT).ids and ids[0][0] == 1
        assert ids[1] == raw.encode(SAMPLES[3], add_special_tokens=False).ids
        assert ids[2] == [1]                   # an empty text is just its special tokens
        rendered = app.encoder.template.render([{"role": r, "content": c} for r, c in chat], False)  # type: ignore[union-attr]
        assert ids[3] == raw.encode(rendered, add_special_tokens=False).ids
        assert ids[3][0] == 1 and ids[3].count(1) == 2    # BOS written by the template, per turn


async def test_texts_and_chats_answer_like_the_library(tiny_dirs: dict[str, pathlib.Path]) -> None:
    """The same ids as the library, as repeated ids or packed (only the one asked for), for texts
    (with and without special tokens, empty) and chats in one call; the token limit still applies."""
    async with running(tiny_dirs["tiny-sentencepiece"], max_input_tokens=1000) as (app, stub):
        raw = app.encoder.tokenizer.tokenizer  # type: ignore[union-attr]
        chat = [("system", "Be brief."), ("user", "Hi 👋")]
        inputs = [text_input(TEXT), text_input(SAMPLES[3], special=False), text_input(""), chat_input(chat)]
        plain = await stub.Tokenize(pb.TokenizeRequest(inputs=inputs))
        packed = await stub.Tokenize(pb.TokenizeRequest(inputs=inputs, packed_ids=True))
        rendered = app.encoder.template.render([{"role": r, "content": c} for r, c in chat], True)  # type: ignore[union-attr]
        expected = [raw.encode(TEXT).ids, raw.encode(SAMPLES[3], add_special_tokens=False).ids, raw.encode("").ids,
                    raw.encode(rendered, add_special_tokens=False).ids]
        assert all(not r.packed_ids for r in plain.results) and all(not r.ids for r in packed.results)
        assert [list(r.ids) for r in plain.results] == expected
        assert [unpack_ids(r.packed_ids) for r in packed.results] == expected
        assert len(packed.results[0].packed_ids) == 4 * len(plain.results[0].ids) > 0
        await expect_error(stub.Tokenize(pb.TokenizeRequest(inputs=[text_input(TEXT * 20)])),
                           grpc.StatusCode.INVALID_ARGUMENT, "PROMPT_TOO_LONG")


async def test_concurrent_callers_get_their_own_results(tiny_dirs: dict[str, pathlib.Path]) -> None:
    async with running(tiny_dirs["tiny-bytelevel"], workers=1) as (app, stub):
        raw = app.encoder.tokenizer.tokenizer  # type: ignore[union-attr]
        rnd = random.Random(5)
        requests = [[rnd.choice(SAMPLES) * rnd.randint(1, 30) for _ in range(rnd.randint(1, 4))] for _ in range(60)]
        responses = await asyncio.gather(*[
            stub.Tokenize(pb.TokenizeRequest(inputs=[text_input(t) for t in texts])) for texts in requests])
        for texts, resp in zip(requests, responses, strict=True):
            assert [list(r.ids) for r in resp.results] == [e.ids for e in raw.encode_batch(texts)]
        assert app.encoder.batcher.pending == 0  # type: ignore[union-attr]


async def test_limits_and_input_errors(tiny_dirs: dict[str, pathlib.Path]) -> None:
    async with running(tiny_dirs["tiny-sentencepiece"], max_input_bytes=1000, max_input_tokens=50,
                       max_batch=4, max_cache_key_bytes=300) as (_, stub):
        invalid = grpc.StatusCode.INVALID_ARGUMENT
        await expect_error(stub.Tokenize(pb.TokenizeRequest()), invalid, "EMPTY_PROMPT")
        await expect_error(stub.Tokenize(pb.TokenizeRequest(inputs=[pb.TokenizeInput()])), invalid, "EMPTY_PROMPT")
        await expect_error(stub.Tokenize(pb.TokenizeRequest(inputs=[chat_input([])])), invalid, "EMPTY_PROMPT")
        await expect_error(stub.Tokenize(pb.TokenizeRequest(inputs=[text_input("é" * 501)])), invalid,
                           "INPUT_TOO_LARGE")
        await expect_error(stub.Tokenize(pb.TokenizeRequest(inputs=[text_input("ok"), text_input("word " * 60)])),
                           invalid, "PROMPT_TOO_LONG")
        await expect_error(stub.Tokenize(pb.TokenizeRequest(inputs=[text_input("x")] * 5)), invalid,
                           "BATCH_TOO_LARGE")
        await expect_error(stub.Tokenize(pb.TokenizeRequest(inputs=[chat_input([("user", "a"), ("user", "b")])])),
                           invalid, "CHAT_TEMPLATE_ERROR")
        # The chat cache key is bounded too (it is stored with the cached ids of its conversation).
        keyed = chat_input([("user", "hi")])
        keyed.chat.cache_key = "k" * 301
        await expect_error(stub.Tokenize(pb.TokenizeRequest(inputs=[keyed])), invalid, "CACHE_KEY_TOO_LONG")
        keyed.chat.cache_key = "é" * 150
        assert len((await stub.Tokenize(pb.TokenizeRequest(inputs=[keyed]))).results[0].ids) > 0
        # The service is unharmed by all that.
        ok = await stub.Tokenize(pb.TokenizeRequest(inputs=[text_input("é" * 20)]))
        assert len(ok.results) == 1


async def test_no_chat_template(tmp_path: pathlib.Path) -> None:
    directory = build_bytelevel(tmp_path / "plain", chat_template=None)
    async with running(directory) as (_, stub):
        assert not (await stub.Info(pb.InfoRequest())).has_chat_template
        await expect_error(stub.Tokenize(pb.TokenizeRequest(inputs=[chat_input([("user", "hi")])])),
                           grpc.StatusCode.INVALID_ARGUMENT, "NO_CHAT_TEMPLATE")
    async with running(directory, chat_template="chatml") as (_, stub):
        resp = await stub.Tokenize(pb.TokenizeRequest(inputs=[chat_input([("user", "hi")])]))
        assert len(resp.results[0].ids) > 3


async def test_overload_is_unavailable(tiny_dirs: dict[str, pathlib.Path]) -> None:
    async with running(tiny_dirs["tiny-bytelevel"], workers=1, max_batch=2, max_pending=2,
                       inline_bytes=0) as (app, stub):
        batcher = app.encoder.batcher  # type: ignore[union-attr]
        release, entered = threading.Event(), threading.Event()
        process = batcher._process

        def gated(jobs: Any) -> Any:
            entered.set()
            release.wait(10)
            return process(jobs)

        batcher._process = gated
        first = asyncio.ensure_future(stub.Tokenize(pb.TokenizeRequest(inputs=[text_input("a"), text_input("b")])))
        deadline = asyncio.get_running_loop().time() + 10
        while not entered.is_set():
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.01)
        await expect_error(stub.Tokenize(pb.TokenizeRequest(inputs=[text_input("c")])),
                           grpc.StatusCode.UNAVAILABLE, "OVERLOADED")
        release.set()
        assert len((await first).results) == 2
        assert len((await stub.Tokenize(pb.TokenizeRequest(inputs=[text_input("c")]))).results) == 1


async def test_multiplexed_detokenize(tiny_dirs: dict[str, pathlib.Path]) -> None:
    async with running(tiny_dirs["tiny-sentencepiece"]) as (app, stub):
        raw = app.encoder.tokenizer.tokenizer  # type: ignore[union-attr]
        texts = {f"r{i}": SAMPLES[i % len(SAMPLES)] for i in range(20)}
        ids = {rid: raw.encode(t, add_special_tokens=False).ids for rid, t in texts.items()}
        call = stub.Detokenize()
        # One message opens all twenty and carries the first half of every request's tokens.
        await call.write(pb.DetokenizeRequest(
            open=[pb.DetokOpen(request_id=rid) for rid in texts],
            tokens=[pb.DetokTokens(request_id=rid, token_ids=v[:len(v) // 2]) for rid, v in ids.items()]))
        first = await call.read()
        got = {o.request_id: o.text for o in first.outputs}
        assert set(got) == set(texts) and not any(o.finished or o.error for o in first.outputs)
        # The rest, final, plus an unknown id: one message in, one message out.
        await call.write(pb.DetokenizeRequest(tokens=[
            *[pb.DetokTokens(request_id=rid, token_ids=v[len(v) // 2:], final=True) for rid, v in ids.items()],
            pb.DetokTokens(request_id="ghost", token_ids=[5])]))
        second = await call.read()
        for out in second.outputs:
            if out.request_id == "ghost":
                assert out.error == "UNKNOWN_REQUEST"
                continue
            assert out.finished and not out.error and out.tokens_consumed == len(ids[out.request_id])
            got[out.request_id] += out.text
        assert {o.request_id for o in second.outputs} == {*texts, "ghost"}
        assert got == {rid: raw.decode(v) for rid, v in ids.items()}
        # Stop strings over the wire, then the stream is still usable.
        stop_ids = raw.encode("one two three", add_special_tokens=False).ids
        await call.write(pb.DetokenizeRequest(open=[pb.DetokOpen(request_id="s", stop=["two"], include_stop_str=True)],
                                              tokens=[pb.DetokTokens(request_id="s", token_ids=stop_ids)]))
        (out,) = (await call.read()).outputs
        assert (out.text, out.finished, out.matched_stop) == ("one two", True, "two")
        # A long prompt as prefix_ids: the continuation keeps its leading space.
        prompt = raw.encode(TEXT * 30 + " Hello").ids
        world = raw.encode(TEXT * 30 + " Hello world").ids[len(prompt):]
        await call.write(pb.DetokenizeRequest(
            open=[pb.DetokOpen(request_id="p", prefix_ids=prompt, skip_special_tokens=True)],
            tokens=[pb.DetokTokens(request_id="p", token_ids=world, final=True)]))
        (out,) = (await call.read()).outputs
        assert (out.text, out.finished) == (" world", True)
        await call.done_writing()
        assert await call.read() == grpc.aio.EOF
