"""The Tokenize use case without a network: inputs, chat rendering, limits, the finish hook."""

from __future__ import annotations

import asyncio
import threading

import pytest
from tok_artefacts import SAMPLES

from services.errors import InvalidArgument, Unavailable
from services.tokenization.chat_template import ChatTemplate
from services.tokenization.encoder import ChatInput, Encoder, EncoderLimits, TextInput
from services.tokenization.loader import LoadedTokenizer
from tests.waiting import poll


async def test_mixed_inputs_and_finish_runs_off_the_loop(tiny_sp: LoadedTokenizer) -> None:
    template = ChatTemplate(tiny_sp.chat_templates["default"], "default", tiny_sp.special_tokens)
    encoder = Encoder(tiny_sp, template, EncoderLimits(inline_bytes=0), workers=2)
    await encoder.start()
    try:
        threads: list[str] = []

        def finish(ids: list[list[int]]) -> list[int]:
            threads.append(threading.current_thread().name)
            return [len(seq) for seq in ids]

        chat = [{"role": "user", "content": "Hi"}]
        inputs = [TextInput(SAMPLES[0], True), TextInput(SAMPLES[2], False), ChatInput(chat, True)]
        raw = tiny_sp.tokenizer
        expected = [raw.encode(SAMPLES[0]).ids, raw.encode(SAMPLES[2], add_special_tokens=False).ids,
                    raw.encode(template.render(chat, True), add_special_tokens=False).ids]
        assert await encoder.tokenize(inputs) == expected
        assert await encoder.tokenize(inputs, finish=finish) == [len(e) for e in expected]
        assert threads and threads[0] != threading.current_thread().name
    finally:
        await encoder.close()
    # By default a call this small that finds the encoder idle is encoded on the loop (no hand-offs).
    inline = Encoder(tiny_sp, template, EncoderLimits(), workers=2)
    await inline.start()
    try:
        threads.clear()
        assert await inline.tokenize(inputs, finish=finish) == [len(e) for e in expected]
        assert threads == [threading.current_thread().name]
    finally:
        await inline.close()


async def test_token_limit_fails_only_the_offending_call(tiny_sp: LoadedTokenizer) -> None:
    encoder = Encoder(tiny_sp, None, EncoderLimits(max_input_tokens=20), workers=1)
    await encoder.start()
    try:
        with pytest.raises(InvalidArgument) as info:
            await encoder.tokenize([TextInput("short"), TextInput(SAMPLES[1] * 3)])
        assert info.value.reason == "PROMPT_TOO_LONG" and "input 1" in info.value.message
        assert await encoder.tokenize([TextInput("short")]) == [tiny_sp.tokenizer.encode("short").ids]
        with pytest.raises(InvalidArgument) as info:
            await encoder.tokenize([ChatInput([{"role": "user", "content": "x"}])])
        assert info.value.reason == "NO_CHAT_TEMPLATE"
    finally:
        await encoder.close()


async def test_a_lone_prompt_is_named_as_the_prompt_not_by_an_index(tiny_sp: LoadedTokenizer) -> None:
    """The router sends a request's prompt alone when it reports its error: the client reads of its
    prompt, not of "input 0" (issue 14)."""
    encoder = Encoder(tiny_sp, None, EncoderLimits(max_input_tokens=20, max_input_bytes=200), workers=1)
    await encoder.start()
    try:
        for text in (SAMPLES[1] * 3, "é" * 101):
            with pytest.raises(InvalidArgument) as info:
                await encoder.tokenize([TextInput(text)])
            assert info.value.message.startswith("the prompt "), info.value.message
            assert "input 0" not in info.value.message
    finally:
        await encoder.close()


async def test_queued_text_beyond_the_byte_budget_is_refused_at_once(tiny_bl):

    encoder = Encoder(tiny_bl, None, EncoderLimits(max_pending_bytes=100, inline_bytes=0), workers=1)
    await encoder.start()
    try:
        # Idle: one call above the budget is still served (a budget never starves a lone caller).
        (big,) = await encoder.tokenize([TextInput("word " * 40)])
        assert big
        # Busy: while 80 bytes are queued, another 80 would exceed 100 and is refused immediately.
        results = await asyncio.gather(encoder.tokenize([TextInput("a" * 80)]),
                                       encoder.tokenize([TextInput("b" * 80)]), return_exceptions=True)
        assert isinstance(results[0], list)
        assert isinstance(results[1], Unavailable) and results[1].reason == "OVERLOADED"
        assert results[1].retry_after is not None
        assert encoder.pending_bytes == 0  # released when calls finish or fail
    finally:
        await encoder.close()


async def test_queued_calls_are_merged_up_to_batch_inputs(tiny_sp: LoadedTokenizer) -> None:
    """Calls carry at most max_batch inputs each, but calls queued behind a running batch are
    encoded together, up to batch_inputs inputs (big batches keep many cores busy)."""
    encoder = Encoder(tiny_sp, None, EncoderLimits(max_batch=2, batch_inputs=6, inline_bytes=0), workers=1)
    sizes: list[int] = []
    entered, gate = threading.Event(), threading.Event()
    inner = encoder._encode_calls

    def recording(calls):  # type: ignore[no-untyped-def]
        entered.set()
        assert gate.wait(10)
        sizes.append(sum(len(c.inputs) for c in calls))
        return inner(calls)

    encoder._encode_calls = recording  # type: ignore[method-assign]
    await encoder.start()
    try:
        with pytest.raises(InvalidArgument) as info:
            await encoder.tokenize([TextInput("a"), TextInput("b"), TextInput("c")])
        assert info.value.reason == "BATCH_TOO_LARGE"
        first = asyncio.create_task(encoder.tokenize([TextInput("first")]))
        assert await asyncio.to_thread(entered.wait, 10)
        texts = [[f"call {i} a", f"call {i} b"] for i in range(5)]
        calls = [asyncio.create_task(encoder.tokenize([TextInput(t) for t in pair])) for pair in texts]
        await poll(lambda: encoder.batcher.pending == 11, what="five calls queued behind the first")
        gate.set()
        results = await asyncio.gather(first, *calls)
        assert results[1:] == [[tiny_sp.tokenizer.encode(t).ids for t in pair] for pair in texts]
        assert sizes == [1, 6, 4]
    finally:
        gate.set()
        await encoder.close()
