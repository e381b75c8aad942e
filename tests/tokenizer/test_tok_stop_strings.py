"""Stop strings: hold-back, matching across token boundaries, tokens_consumed, include_stop_str."""

from __future__ import annotations

import random

import pytest
from tok_artefacts import TEXT

from services.tokenization.detok_stream import DetokStream, OpenRequest, Output, StreamBatch, TokenBatch
from services.tokenization.loader import LoadedTokenizer
from services.tokenization.stop_strings import StopMatcher


# ---------------------------------------------------------------- StopMatcher alone
def test_holds_back_only_possible_stop_prefixes() -> None:
    m = StopMatcher(["STOP"])
    assert m.feed("abc S").text == "abc "
    assert m.held == "S"
    assert m.feed("T").text == ""
    assert m.feed("x").text == "STx"          # "STx" can no longer become "STOP"
    assert m.feed("ST").text == ""
    r = m.feed("OP and more")
    assert (r.text, r.matched) == ("", "STOP")


def test_no_stops_means_no_hold_back() -> None:
    m = StopMatcher(["", ""])
    assert not m.active
    assert m.feed("anything S").text == "anything S"


def test_earliest_completing_stop_wins_then_the_longer() -> None:
    assert StopMatcher(["world", "lo w"]).feed("hello world").matched == "lo w"
    r = StopMatcher(["b", "ab"]).feed("xab")       # both complete at the same character
    assert (r.text, r.matched) == ("x", "ab")
    r = StopMatcher(["cd", "abcdef"]).feed("abcdef")
    assert (r.text, r.matched) == ("ab", "cd")


def test_include_stop_str_and_flush() -> None:
    r = StopMatcher(["</end>"], include_stop_str=True).feed("done</end>tail")
    assert (r.text, r.matched) == ("done</end>", "</end>")
    m = StopMatcher(["</end>"])
    assert m.feed("x</en").text == "x"
    assert m.flush() == "</en"


# ---------------------------------------------------------------- through a stream with real tokens
def run(tok: LoadedTokenizer, ids: list[int], stops: list[str], *, include: bool = False,
        chunk: int | None = 1, seed: int = 0, final: bool = True) -> tuple[str, Output]:
    stream = DetokStream(tok)
    stream.apply(StreamBatch(opens=[OpenRequest("r", stops, include)]))
    rnd = random.Random(seed)
    text, last, pos = "", None, 0
    while pos < len(ids):
        n = chunk or rnd.randint(1, 7)
        part, pos = ids[pos:pos + n], pos + n
        for out in stream.apply(StreamBatch(tokens=[TokenBatch("r", part, final and pos >= len(ids))])):
            assert not out.error
            assert last is None or not last.finished, "nothing after finished"
            text, last = text + out.text, out
    assert last is not None
    return text, last


def first_token_completing(tok: LoadedTokenizer, ids: list[int], stop: str) -> int:
    """Independent reference: the smallest k such that decode(ids[:k]) contains the stop."""
    return next(k for k in range(1, len(ids) + 1) if stop in tok.decode(ids[:k], False))


def encode(tok: LoadedTokenizer, text: str) -> list[int]:
    return tok.tokenizer.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("stop", ["lazy dog", "São Paulo", "日本語", "👩‍👩‍👧‍👦 fam", "return fib", "\n\n\n"])
@pytest.mark.parametrize("include", [False, True])
def test_stop_spanning_tokens(any_tokenizer: LoadedTokenizer, stop: str, include: bool) -> None:
    tok = any_tokenizer
    ids = encode(tok, TEXT)
    full = tok.decode(ids, False)
    assert stop in full
    expected = full[:full.index(stop)] + (stop if include else "")
    consumed = first_token_completing(tok, ids, stop)
    for chunk in (1, None):
        for seed in range(2):
            text, last = run(tok, ids, [stop, "never-there"], include=include, chunk=chunk, seed=seed)
            assert text == expected
            assert last.finished and last.matched_stop == stop
            assert last.tokens_consumed == consumed


def test_multiple_stops_first_to_complete_wins(any_tokenizer: LoadedTokenizer) -> None:
    tok = any_tokenizer
    ids = encode(tok, TEXT)
    full = tok.decode(ids, False)
    text, last = run(tok, ids, ["Zürich", "naïve", "fox"], chunk=None)
    assert last.matched_stop == "fox"
    assert text == full[:full.index("fox")]


def test_stop_at_the_very_start(any_tokenizer: LoadedTokenizer) -> None:
    tok = any_tokenizer
    ids = encode(tok, "Hello world")
    text, last = run(tok, ids, ["Hel"])
    assert (text, last.matched_stop, last.finished) == ("", "Hel", True)
    assert last.tokens_consumed == first_token_completing(tok, ids, "Hel")
    text, last = run(tok, ids, ["Hel"], include=True)
    assert text == "Hel"


def test_no_match_flushes_held_text_on_final(any_tokenizer: LoadedTokenizer) -> None:
    tok = any_tokenizer
    ids = encode(tok, "the end is near")
    stop = "nearly"   # the text ends with a prefix of the stop: held back until final
    stream = DetokStream(tok)
    stream.apply(StreamBatch(opens=[OpenRequest("r", [stop])]))
    outs = stream.apply(StreamBatch(tokens=[TokenBatch("r", ids)]))
    assert "".join(o.text for o in outs) == "the end is "
    outs = stream.apply(StreamBatch(tokens=[TokenBatch("r", [], final=True)]))
    assert [(o.text, o.finished, o.matched_stop) for o in outs] == [("near", True, "")]
    assert outs[0].tokens_consumed == len(ids)


def test_tokens_after_a_stop_are_ignored(any_tokenizer: LoadedTokenizer) -> None:
    tok = any_tokenizer
    ids = encode(tok, "one two three four")
    stream = DetokStream(tok)
    stream.apply(StreamBatch(opens=[OpenRequest("r", ["two"])]))
    outs = stream.apply(StreamBatch(tokens=[TokenBatch("r", ids)]))
    assert len(outs) == 1 and outs[0].finished and outs[0].matched_stop == "two"
    assert outs[0].text == "one "
    # The engine may still send a few tokens before it learns of the stop: silently ignored.
    assert stream.apply(StreamBatch(tokens=[TokenBatch("r", ids)])) == []
    assert stream.apply(StreamBatch(tokens=[TokenBatch("r", ids, final=True)])) == []
    # After the final message the id is forgotten.
    outs = stream.apply(StreamBatch(tokens=[TokenBatch("r", ids)]))
    assert [o.error for o in outs] == ["UNKNOWN_REQUEST"]
