"""The router's own tokenizer, with the byte-level tokenizer: `LocalDetokenize` (router_svc/
local_detok.py: outputs merged while not taken, a failure as a marker, state dropped on close, the
start check that refuses another tokenizer) and `LocalTokenize` (local_tokenize.py: which prompts
are encoded here, and that an encode on the loop lets the early ENQUEUE go out first)."""

from __future__ import annotations

import asyncio

from router_svc.local_detok import PROBE, LocalDetokenize, mismatch
from router_svc.local_tokenize import LocalTokenize, template_of
from router_svc.types import DetokOut, TokenizerMeta
from services.errors import Reason
from services.mux import StreamBroken


def _ids(local: LocalDetokenize, text: str) -> list[int]:
    return local.tokenizer.tokenizer.encode(text, add_special_tokens=False).ids


async def test_outputs_not_taken_yet_merge_and_the_last_one_finishes(local):
    s = local.detokenizer("merge")
    s.start([], False, _ids(local, "prompt: "), {})
    for part in ("Hello", ", ", "wor", "ld"):
        s.send(_ids(local, part), final=False)
    s.send(_ids(local, "!"), final=True)
    ready = await s.next_ready()
    assert [type(o) for o in ready] == [DetokOut, DetokOut]   # four merged, the final one apart
    assert "".join(o.text for o in ready) == "Hello, world!"
    assert ready[-1].finished and ready[-1].tokens_consumed == len(_ids(local, "Hello, world!"))
    s.close(flushed=True)
    assert local.open_requests == 0


async def test_a_stop_string_ends_the_request_at_the_token_that_completes_it(local):
    s = local.detokenizer("stop")
    s.start(["STOP"], False, [], {})
    s.send(_ids(local, "keep this STOP not this"), final=False)
    (out,) = await s.next_ready()
    assert (out.text, out.finished, out.matched_stop) == ("keep this ", True, "STOP")
    assert out.tokens_consumed == len(_ids(local, "keep this STOP"))
    s.send(_ids(local, " trailing"), final=True)   # ids the engine sent before it saw the stop
    s.close(flushed=True)
    assert local.open_requests == 0


async def test_close_before_the_end_drops_the_state_and_fail_reaches_the_consumer(local):
    s = local.detokenizer("cut")
    s.start([], False, [], {})
    s.send(_ids(local, "half"), final=False)
    assert local.open_requests == 1
    s.fail(Reason.ENGINE_ERROR.error("engine went away"))
    ready = await s.next_ready()
    assert isinstance(ready[-1], StreamBroken) and ready[-1].error.reason == Reason.ENGINE_ERROR
    s.close(flushed=False)
    s.close(flushed=False)    # twice is harmless
    assert local.open_requests == 0


async def test_a_duplicate_id_and_an_id_outside_the_vocabulary_are_in_band_errors(local):
    first = local.detokenizer("dup")
    first.start([], False, [], {})
    second = local.detokenizer("dup")
    second.start([], False, [], {})
    (out,) = await second.next_ready()
    assert out.error == Reason.DUPLICATE_REQUEST_ID and not out.finished   # the first one carries on
    from services.tokenization import metrics as tm
    counted = tm.DETOK_TOKENS._value.get()
    first.send([local.tokenizer.vocab_size + 5], final=False)
    (bad,) = await first.next_ready()
    assert bad.error == Reason.INVALID_TOKEN_ID and bad.finished
    first.close(flushed=False)
    assert local.open_requests == 0
    assert tm.DETOK_TOKENS._value.get() == counted      # an id refused is not a token detokenized


async def test_one_id_at_a_time_gives_the_batch_paths_text_counts_and_ends(local):
    """A one-token delta skips the batch path (`DetokStream.feed_one`): the same text, split at the
    same characters (multi-byte ones held until complete), the same tokens_consumed, the same
    DETOK_TOKENS count once the session closes; the last id and a request with stop strings take
    the batch path."""
    from services.tokenization import metrics as tm
    text = "Hello, naïve 世界 — ok"
    ids = _ids(local, text)
    assert len(ids) > len(text)          # multi-byte characters span several ids
    batch = local.detokenizer("batch")
    batch.start([], False, _ids(local, "prompt: "), {})
    batch.send(ids, final=True)
    (whole,) = await batch.next_ready()
    batch.close(flushed=True)
    counted = tm.DETOK_TOKENS._value.get()
    one = local.detokenizer("one")
    one.start([], False, _ids(local, "prompt: "), {})
    texts = []
    for i in ids[:-1]:
        one.send([i], final=False)
        while one._inbox.qsize():
            out = one._inbox.get_nowait()
            assert not out.finished and out.tokens_consumed <= len(ids)
            texts.append(out.text)
    assert tm.DETOK_TOKENS._value.get() == counted       # counted when the session closes
    assert "\ufffd" not in "".join(texts)                # no half character went out
    one.send(ids[-1:], final=True)
    (last,) = await one.next_ready()
    one.close(flushed=True)
    assert "".join(texts) + last.text == whole.text == text
    assert last.finished and last.tokens_consumed == whole.tokens_consumed == len(ids)
    assert tm.DETOK_TOKENS._value.get() == counted + len(ids)
    assert local.open_requests == 0
    stops = local.detokenizer("stops")
    stops.start(["ve 世"], False, [], {})
    assert stops._plain is None
    for i in ids:
        stops.send([i], final=False)
    outs = await stops.next_ready()
    assert "".join(o.text for o in outs) == "Hello, naï" and outs[-1].matched_stop == "ve 世"
    stops.close(flushed=True)


async def test_a_decoder_failure_on_the_one_id_path_ends_only_that_request_as_internal(local, monkeypatch):
    """...and reports the ids applied before the failing one, as the batch path does (the one-id path
    counted the failing id too: one more than the batch path for the same failure)."""
    from services.tokenization.detokenizer import IncrementalDecoder
    other = local.detokenizer("other")
    other.start([], False, [], {})
    s = local.detokenizer("fails")
    s.start([], False, [], {})
    batch = local.detokenizer("fails-batch")       # a stop string: the batch path, id by id
    batch.start(["zzz"], False, [], {})
    many = local.detokenizer("fails-many")         # no stop string, several ids at once: the batch path's extend
    many.start([], False, [], {})
    assert s._plain is not None and batch._plain is None
    for session in (s, batch, many):
        session.send(_ids(local, "a"), final=False)
    def broken(self, *args):
        raise RuntimeError("decoder bug")
    monkeypatch.setattr(IncrementalDecoder, "step", broken)
    monkeypatch.setattr(IncrementalDecoder, "extend", broken)
    for session in (s, batch):
        session.send(_ids(local, "b"), final=False)
    many.send(_ids(local, "bc"), final=False)
    outs = await s.next_ready()
    batch_outs = await batch.next_ready()
    many_outs = await many.next_ready()
    assert many_outs[-1].error == Reason.INTERNAL and many_outs[-1].tokens_consumed == 1
    many.close(flushed=True)
    assert outs[-1].error == Reason.INTERNAL and outs[-1].finished
    assert batch_outs[-1].error == Reason.INTERNAL and batch_outs[-1].finished
    assert outs[-1].tokens_consumed == batch_outs[-1].tokens_consumed == len(_ids(local, "a")) == 1
    batch.close(flushed=True)
    s.send(_ids(local, "c"), final=True)      # ids already on their way: dropped, no second error
    assert s._inbox.qsize() == 0
    s.close(flushed=True)
    monkeypatch.undo()
    other.send(_ids(local, "fine"), final=True)
    (out,) = await other.next_ready()
    assert out.text == "fine" and out.finished
    other.close(flushed=True)
    assert local.open_requests == 0


def test_the_start_check_accepts_the_same_tokenizer_and_names_each_difference(local):
    tok = local.tokenizer
    same = TokenizerMeta(tok.name, tok.vocab_size, list(tok.eos_token_ids), tok.bos_token_id, tok.max_context, True)
    probe = tok.tokenizer.encode(PROBE, add_special_tokens=True).ids
    assert mismatch(tok, same, probe) == ""
    other = TokenizerMeta("other", tok.vocab_size + 1, [0], None, 0, False)
    why = mismatch(tok, other, probe[:-1])
    assert f"vocabulary {tok.vocab_size} here, {tok.vocab_size + 1}" in why
    assert "end-of-sequence ids" in why and "probe text encodes to" in why
    assert "different ids" in mismatch(tok, same, [i + 1 for i in probe])


class _Remote:
    """The tokenizer service as `LocalTokenize` sees it: metadata and Tokenize (records calls)."""

    def __init__(self, tok, has_chat_template: bool = True) -> None:
        self.meta = TokenizerMeta(tok.name, tok.vocab_size, list(tok.eos_token_ids), tok.bos_token_id,
                                  tok.max_context, has_chat_template)
        self.calls: list[dict] = []

    async def tokenize(self, **kw):
        self.calls.append(kw)
        return [1, 2, 3]


def _local_tok(local: LocalDetokenize, max_bytes: int = 64, **kw) -> LocalTokenize:
    tok = local.tokenizer
    return LocalTokenize(_Remote(tok, **kw), tok, template_of(tok, ""), max_bytes)


async def test_short_prompts_are_encoded_here_long_ones_and_chats_without_a_service_template_there(local):
    lt = _local_tok(local)
    await lt.start()
    try:
        assert await lt.tokenize(text="short") == local.tokenizer.tokenizer.encode("short").ids
        assert await lt.tokenize(text="x" * 65) == [1, 2, 3]                  # over the bound: the service
        chat = [("user", "hi")]
        assert await lt.tokenize(messages=chat) != [1, 2, 3]
        assert len(lt.remote.calls) == 1 and lt.local_calls == 2
        none = _local_tok(local, has_chat_template=False)   # the service has no template: its answer counts
        assert await none.tokenize(messages=chat) == [1, 2, 3]
    finally:
        await lt.close()


async def test_tokenize_now_gives_the_same_ids_in_the_same_turn_or_says_it_cannot(local):
    lt = _local_tok(local)
    await lt.start()
    loop = asyncio.get_running_loop()
    turned: list[int] = []
    loop.call_soon(turned.append, 1)
    try:
        chat = [("system", "be brief"), ("user", "hi")]
        assert lt.tokenize_now(text="short") == local.tokenizer.tokenizer.encode("short").ids
        assert lt.tokenize_now(messages=chat) == await _after_turn(lt.tokenize(messages=chat), turned)
        assert lt.tokenize_now(text="x" * 65) is None                         # the service's: not here
        assert lt.remote.calls == [] and lt.local_calls == 3
        # An encoder busy with another call: not now (the call queues behind it instead).
        lt.encoder.batcher._idle -= 1
        assert lt.tokenize_now(text="short") is None
        lt.encoder.batcher._idle += 1
        assert _local_tok(local, has_chat_template=False).tokenize_now(messages=chat) is None
    finally:
        await lt.close()
    assert lt.tokenize_now(text="short") is None                               # closed: the async path says why


async def _after_turn(aw, turned: list[int]):
    """`aw`'s result, checking that the calls before it ran without a loop turn."""
    assert turned == []
    return await aw
