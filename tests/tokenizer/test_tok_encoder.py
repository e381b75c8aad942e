"""The Tokenize use case without a network: inputs, chat rendering, limits, the finish hook."""

from __future__ import annotations

import asyncio
import threading

import pytest
from tok_artefacts import SAMPLES

from services.errors import InvalidArgument, Unavailable
from tokenizer_svc.chat_template import ChatTemplate
from tokenizer_svc.encoder import ChatInput, Encoder, EncoderLimits, TextInput
from tokenizer_svc.loader import LoadedTokenizer


async def test_mixed_inputs_and_finish_runs_off_the_loop(tiny_sp: LoadedTokenizer) -> None:
    template = ChatTemplate(tiny_sp.chat_templates["default"], "default", tiny_sp.special_tokens)
    encoder = Encoder(tiny_sp, template, EncoderLimits(), workers=2)
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


async def test_queued_text_beyond_the_byte_budget_is_refused_at_once(tiny_bl):

    encoder = Encoder(tiny_bl, None, EncoderLimits(max_pending_bytes=100), workers=1)
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
