"""Exactness of incremental detokenization: concatenated deltas == the full decode.

Runs over every tokenizer (tiny byte-level BPE and byte-fallback SentencePiece built here; GPT-2,
Llama 2, Mistral from ../shared/data when present), token by token, in random chunks, with and
without prompt prefix ids, with special tokens skipped or kept.
"""

from __future__ import annotations

import random

import pytest
from tok_artefacts import SAMPLES, TEXT

from services.tokenization.detok_stream import DetokStream, OpenRequest, StreamBatch, TokenBatch
from services.tokenization.detokenizer import MAX_CONTEXT_TOKENS, MAX_UNREAD, IncrementalDecoder
from services.tokenization.loader import LoadedTokenizer

FFFD = "\ufffd"


def encode(tok: LoadedTokenizer, text: str) -> list[int]:
    return tok.tokenizer.encode(text, add_special_tokens=False).ids


def decoder(tok: LoadedTokenizer, *, skip: bool = False, prefix: list[int] | None = None) -> IncrementalDecoder:
    return IncrementalDecoder(tok.decode, skip_special_tokens=skip, special_ids=tok.special_ids,
                              prefix_ids=prefix or [], token_bytes=tok.token_bytes)


def stream_one_by_one(tok: LoadedTokenizer, ids: list[int], **kw: object) -> str:
    dec = decoder(tok, **kw)  # type: ignore[arg-type]
    return "".join(dec.step(t) for t in ids) + dec.flush()


def seen_before_cut(tok: LoadedTokenizer, prefix: list[int], skip: bool) -> str:
    """What a client streaming `prefix` has received when the stream is cut there (no flush)."""
    dec = decoder(tok, skip=skip)
    return "".join(dec.step(t) for t in prefix)


def reference(tok: LoadedTokenizer, prefix: list[int], generated: list[int], skip: bool) -> str:
    """decode(P + G)[len(decode(P)):]; when P ends inside a character, the text after what a
    client streaming P has seen (so that seen + continuation == decode(P + G))."""
    full = tok.decode(prefix + generated, skip)
    head = tok.decode(prefix, skip)
    if not head.endswith(FFFD):
        return full[len(head):]
    seen = seen_before_cut(tok, prefix, skip)
    assert full.startswith(seen)
    return full[len(seen):]


@pytest.mark.parametrize("sample", range(len(SAMPLES)))
def test_token_by_token_equals_full_decode(any_tokenizer: LoadedTokenizer, sample: int) -> None:
    ids = encode(any_tokenizer, SAMPLES[sample])
    assert stream_one_by_one(any_tokenizer, ids) == any_tokenizer.decode(ids, False)


def test_whole_text_with_special_tokens_kept_and_skipped(any_tokenizer: LoadedTokenizer) -> None:
    tok = any_tokenizer
    specials = sorted(tok.special_ids)
    assert specials, "every test tokenizer has special tokens"
    rnd = random.Random(7)
    ids = encode(tok, TEXT)
    # Special tokens sprinkled in between characters, and first and last, like BOS/EOS around turns.
    # (Inside a character's bytes they would make the bytes invalid, and byte fallback then turns
    # the whole byte run into U+FFFD after the fact, which no stream can reproduce.)
    boundaries = [p for p in range(1, len(ids)) if not tok.decode(ids[:p], False).endswith(FFFD)]
    for pos in sorted(rnd.sample(boundaries, 12), reverse=True):
        ids.insert(pos, rnd.choice(specials))
    ids = [specials[0], *ids, specials[-1]]
    for skip in (False, True):
        assert stream_one_by_one(tok, ids, skip=skip) == tok.decode(ids, skip)


def test_deltas_are_emitted_as_soon_as_characters_complete(any_tokenizer: LoadedTokenizer) -> None:
    tok = any_tokenizer
    ids = encode(tok, TEXT)
    full = tok.decode(ids, False)
    dec = decoder(tok)
    emitted = ""
    for i, token_id in enumerate(ids):
        emitted += dec.step(token_id)
        assert full.startswith(emitted)
        # Only an unfinished character (shown as U+FFFD by decode) may be held back.
        assert len(emitted) >= len(tok.decode(ids[:i + 1], False).rstrip(FFFD))
    assert emitted + dec.flush() == full


def test_random_chunks_through_a_stream(any_tokenizer: LoadedTokenizer) -> None:
    tok = any_tokenizer
    ids = encode(tok, TEXT)
    for seed in range(3):
        rnd = random.Random(seed)
        stream = DetokStream(tok)
        assert not stream.apply(StreamBatch(opens=[OpenRequest("r")]))
        pos, text, finished = 0, "", False
        while pos < len(ids):
            n = rnd.randint(1, 9)
            chunk, pos = ids[pos:pos + n], pos + n
            outs = stream.apply(StreamBatch(tokens=[TokenBatch("r", chunk, final=pos >= len(ids))]))
            assert len(outs) <= 1
            for out in outs:
                assert not out.error
                text += out.text
                finished = out.finished
                assert out.tokens_consumed == min(pos, len(ids))
        assert finished
        assert text == TEXT
        assert stream.open_requests == 0


def test_prefix_ids_at_every_cut_point(any_tokenizer: LoadedTokenizer) -> None:
    tok = any_tokenizer
    ids = encode(tok, TEXT)
    ends = [e for e in range(len(ids) + 1) if not tok.decode(ids[:e], False).endswith(FFFD)]
    for cut in range(1, len(ids)):
        # What happens at the seam is what matters; a short continuation (ending on a character
        # boundary, as a valid generation does) keeps this fast.
        end = next(e for e in ends if e >= cut + 24) if cut + 24 <= ends[-1] else len(ids)
        prefix, generated = ids[:cut], ids[cut:end]
        for skip in (False, True):
            got = stream_one_by_one(tok, generated, skip=skip, prefix=prefix)
            assert got == reference(tok, prefix, generated, skip), (cut, skip)


def test_prefix_keeps_the_leading_space(any_tokenizer: LoadedTokenizer) -> None:
    # The bug Triton's per-response decode has: " world" must not come out as "world".
    tok = any_tokenizer
    ids = encode(tok, "Hello world")
    cut = next(c for c in range(len(ids)) if tok.decode(ids[:c], False) == "Hello")
    assert stream_one_by_one(tok, ids[cut:], prefix=ids[:cut]) == " world"
    assert stream_one_by_one(tok, ids[cut:], prefix=ids[:cut], skip=True) == " world"


def test_prefix_that_ends_inside_a_character(any_tokenizer: LoadedTokenizer) -> None:
    """A stream resumed mid-character (token migration) loses and repeats nothing."""
    tok = any_tokenizer
    text = "family: 👩‍👩‍👧‍👦! 中文 𓀀 ok"
    ids = encode(tok, text)
    cuts = [c for c in range(1, len(ids)) if tok.decode(ids[:c], False).endswith(FFFD)]
    assert cuts, "the emoji and CJK are split over several tokens in every test tokenizer"
    for cut in cuts:
        seen = seen_before_cut(tok, ids[:cut], False)
        got = stream_one_by_one(tok, ids[cut:], prefix=ids[:cut])
        assert seen + got == tok.decode(ids, False)
        assert FFFD not in got


def test_long_prefix_uses_only_a_bounded_tail(any_tokenizer: LoadedTokenizer) -> None:
    tok = any_tokenizer
    seen: list[int] = []

    def counting_decode(ids: list[int], skip: bool) -> str:
        seen.append(len(ids))
        return tok.decode(ids, skip)

    prefix = encode(tok, TEXT * 20)
    generated = encode(tok, " " + TEXT)
    dec = IncrementalDecoder(counting_decode, skip_special_tokens=False, prefix_ids=prefix,
                             token_bytes=tok.token_bytes)
    out = "".join(dec.step(t) for t in generated) + dec.flush()
    assert out == reference(tok, prefix, generated, False)
    # The window never approaches the prompt or the generation length.
    assert max(seen) <= MAX_CONTEXT_TOKENS + MAX_UNREAD
    assert len(prefix) > 50 * max(seen)


def test_generation_window_is_bounded(any_tokenizer: LoadedTokenizer) -> None:
    tok = any_tokenizer
    lengths: list[int] = []

    def counting_decode(ids: list[int], skip: bool) -> str:
        lengths.append(len(ids))
        return tok.decode(ids, skip)

    ids = encode(tok, TEXT * 10)
    dec = IncrementalDecoder(counting_decode, skip_special_tokens=False)
    assert "".join(dec.step(t) for t in ids) + dec.flush() == TEXT * 10
    assert max(lengths) <= 2 * MAX_UNREAD
    assert len(lengths) <= 2 * len(ids) + 2


def test_genuine_replacement_character_and_invalid_bytes(any_tokenizer: LoadedTokenizer) -> None:
    tok = any_tokenizer
    # A real U+FFFD (complete bytes EF BF BD) is text like any other: emitted without waiting.
    ids = encode(tok, "before \ufffd")
    dec = decoder(tok)
    assert "".join(dec.step(t) for t in ids) == tok.decode(ids, False)
    assert dec.flush() == ""
    # A stream that ends in the middle of a character: the final flush emits U+FFFD.
    ids = encode(tok, "cut 𓀀")   # in no training corpus: always split into byte pieces
    cut = max(c for c in range(len(ids)) if tok.decode(ids[:c], False).endswith(FFFD))
    dec = decoder(tok)
    assert "".join(dec.step(t) for t in ids[:cut]) == "cut "
    assert dec.flush() == tok.decode(ids[:cut], False)[len("cut "):]
    assert dec.flush() == ""


def test_stray_bytes_are_not_held_back(tiny_sp: LoadedTokenizer) -> None:
    tok = tiny_sp
    stray = tok.tokenizer.token_to_id("<0x80>")   # a continuation byte with no lead byte
    assert stray is not None
    dec = decoder(tok)
    out = "".join(dec.step(t) for t in [*encode(tok, "x"), stray])
    assert out == "x" + FFFD
    # Without the raw bytes of tokens, the decoder still gives up waiting after MAX_UNREAD ids.
    blind = IncrementalDecoder(tok.decode, skip_special_tokens=False)
    out = "".join(blind.step(t) for t in [*encode(tok, "x"), *([stray] * MAX_UNREAD)])
    assert out.startswith("x") and FFFD in out
