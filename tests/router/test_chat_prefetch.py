"""A finished chat turn is tokenized ahead of the next one (`Router._prefetch`, `LocalTokenize.prefetch`):
its conversation with the reply the client got, under the key the next turn uses, so that the next
turn encodes only its new message. The core with fakes: when it runs and what it is given; the
router's own tokenizer (byte-level): the next turn's ids stay exactly those of encoding the whole
chat, and the reply is no longer encoded on its path."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from router_svc.cache_key import tokenize_cache_key
from router_svc.local_tokenize import LocalTokenize, template_of
from router_svc.types import Delta, Done, GenerateInput, Sampling
from services.errors import Reason, TokenrelayError
from tests.router.core_fakes import TENANT, FakeReplica, core, uid

TURN1 = [("system", "You answer briefly."), ("user", "What is a KV cache?")]


def _recording(c) -> list[dict[str, Any]]:
    calls: list[dict[str, Any]] = []

    def prefetch(**kw: Any) -> bool:
        calls.append(kw)
        return True

    c.tokenizer.prefetch = prefetch
    return calls


async def _run(c, inp: GenerateInput) -> tuple[str, list[object]]:
    events = [e async for e in c.router.generate(TENANT, inp)]
    return "".join(e.text for e in events if isinstance(e, Delta)), events


async def test_a_finished_chat_turn_is_tokenized_ahead_with_the_reply_the_client_got() -> None:
    c = core()
    calls = _recording(c)
    for session in ("", "s1"):
        reply, events = await _run(c, GenerateInput(Sampling(max_tokens=3), messages=TURN1, session_id=session))
        assert isinstance(events[-1], Done) and reply
        await asyncio.sleep(0)                      # the prefetch runs in the next loop turn, after the done
        messages = [*TURN1, ("assistant", reply)]
        assert calls[-1] == {"messages": messages, "allow_special_tokens": False,
                             "cache_key": tokenize_cache_key("t", session, [*messages, ("user", "Next?")])}
    assert calls[0]["cache_key"].startswith("t/~") and calls[1]["cache_key"] == "t/s1"


async def test_no_prefetch_for_a_text_prompt_a_failed_turn_or_when_turned_off() -> None:
    c = core(FakeReplica("e1", ["ok", Reason.INVALID_SAMPLING]))
    calls = _recording(c)
    await _run(c, GenerateInput(Sampling(max_tokens=3), prompt="plain text"))
    with pytest.raises(TokenrelayError) as failed:   # the engine's refusal reaches the client...
        await _run(c, GenerateInput(Sampling(max_tokens=3), messages=TURN1))
    assert failed.value.reason == Reason.INVALID_SAMPLING   # ...and nothing is prefetched for it
    off = core(chat_prefetch_max_in_flight=0)
    off_calls = _recording(off)
    await _run(off, GenerateInput(Sampling(max_tokens=3), messages=TURN1))
    await asyncio.sleep(0)
    assert calls == [] and off_calls == []


async def test_not_while_the_router_has_its_limit_of_requests_in_flight() -> None:
    c = core(FakeReplica("e1", ["inbox", "ok"]), chat_prefetch_max_in_flight=1)
    calls = _recording(c)
    held = asyncio.ensure_future(_run(c, GenerateInput(Sampling(max_tokens=3), messages=TURN1, request_id="a")))
    for _ in range(50):
        if c.router.live("t", "a") is not None and c.engines.replicas["e1"].submitted:
            break
        await asyncio.sleep(0)
    await _run(c, GenerateInput(Sampling(max_tokens=3), messages=TURN1, session_id="b"))   # "a" is live
    await asyncio.sleep(0)
    assert calls == []
    c.engines.replicas["e1"].sources[uid(c, "a")].tokens(7, finished=True)   # type: ignore[attr-defined]
    await held
    await asyncio.sleep(0)
    assert len(calls) == 1


async def test_the_next_turn_encodes_only_its_message_and_its_ids_stay_exact(local) -> None:
    tok = local.tokenizer
    service = SimpleNamespace(meta=SimpleNamespace(has_chat_template=True))   # never called
    lt = LocalTokenize(service, tok, template_of(tok, ""), 1 << 20)
    whole_lt = LocalTokenize(service, tok, template_of(tok, ""), 1 << 20)     # no cache key: plain encodes
    await lt.start()
    await whole_lt.start()
    try:
        cache = lt.encoder.chat_cache
        assert cache is not None
        reply = "Attention keys and values, kept per token so that each step reads them back."
        turn2 = [*TURN1, ("assistant", reply), ("user", "Why page it?")]
        edited = [*TURN1, ("assistant", reply.upper()), ("user", "Why page it?")]
        for nxt in (turn2, edited):
            key = tokenize_cache_key("t", "s", nxt)
            first = await lt.tokenize(messages=TURN1, cache_key=key)
            assert lt.prefetch(messages=[*TURN1, ("assistant", reply)], cache_key=key)
            reused = cache.reused_tokens
            ids = await lt.tokenize(messages=nxt, cache_key=key)
            assert ids == await whole_lt.tokenize(messages=nxt)            # exact either way
            if nxt is turn2:     # the reply's tokens came from the prefetch, not from this encode: the
                # encode starts at the reply's <|im_end|> (byte-level: a token per byte of ASCII)
                assert cache.reused_tokens - reused == len(first) + len(reply)
            else:   # an edited reply: reused up to the reply's header (its <|im_start|>), as without the prefetch
                assert cache.reused_tokens - reused == len(first) - 1 - len("assistant\n")   # 1: <|im_start|>'s id
        # Nothing to do without a key, or for a chat this process does not tokenize (too long here),
        # or while its encoder is not idle (a request's own encode never waits behind a prefetch).
        assert not lt.prefetch(messages=turn2, cache_key="")
        small = LocalTokenize(service, tok, template_of(tok, ""), 16)
        assert not small.prefetch(messages=turn2, cache_key="t/s")
        stored = len(cache)
        lt.encoder.tokenize_now = lambda items: None     # type: ignore[method-assign]   # as when busy
        assert not lt.prefetch(messages=turn2, cache_key="t/other")
        assert len(cache) == stored
    finally:
        await lt.close()
        await whole_lt.close()
