"""A multiplexed Detokenize stream (domain level): many requests per batch, errors per request."""

from __future__ import annotations

import random

from tok_artefacts import SAMPLES

from services.tokenization.detok_stream import (
    MAX_STOP_CHARS,
    MAX_STOPS,
    DetokStream,
    OpenRequest,
    StreamBatch,
    TokenBatch,
)
from services.tokenization.loader import LoadedTokenizer


def encode(tok: LoadedTokenizer, text: str) -> list[int]:
    return tok.tokenizer.encode(text, add_special_tokens=False).ids


def test_many_requests_interleaved_in_each_batch(tiny_sp: LoadedTokenizer) -> None:
    tok = tiny_sp
    rnd = random.Random(3)
    streams = {f"req-{i}": encode(tok, SAMPLES[i % len(SAMPLES)] * (1 + i % 3)) for i in range(24)}
    stream = DetokStream(tok)
    assert stream.apply(StreamBatch(opens=[OpenRequest(rid) for rid in streams])) == []
    assert stream.open_requests == len(streams)
    pos = dict.fromkeys(streams, 0)
    texts = dict.fromkeys(streams, "")
    finished: set[str] = set()
    while len(finished) < len(streams):
        batch = []
        for rid, ids in streams.items():
            if rid in finished or rnd.random() < 0.3:
                continue
            n = rnd.randint(1, 5)
            batch.append(TokenBatch(rid, ids[pos[rid]:pos[rid] + n], final=pos[rid] + n >= len(ids)))
            pos[rid] += n
        outs = stream.apply(StreamBatch(tokens=batch))
        ids_out = [o.request_id for o in outs]
        assert len(ids_out) == len(set(ids_out)), "one output per request per batch"
        for out in outs:
            assert not out.error
            assert out.text or out.finished, "empty deltas are left out"
            texts[out.request_id] += out.text
            if out.finished:
                finished.add(out.request_id)
    for rid, ids in streams.items():
        assert texts[rid] == tok.decode(ids, False)
    assert stream.open_requests == 0


def test_repeated_items_for_one_request_are_merged(tiny_sp: LoadedTokenizer) -> None:
    ids = encode(tiny_sp, "Hello world, again")
    stream = DetokStream(tiny_sp)
    stream.apply(StreamBatch(opens=[OpenRequest("a")]))
    outs = stream.apply(StreamBatch(tokens=[TokenBatch("a", ids[:2]), TokenBatch("a", ids[2:], final=True)]))
    assert [(o.request_id, o.text, o.finished, o.tokens_consumed) for o in outs] == [
        ("a", "Hello world, again", True, len(ids))]


def test_unknown_duplicate_and_invalid(tiny_sp: LoadedTokenizer) -> None:
    stream = DetokStream(tiny_sp)
    ids = encode(tiny_sp, "Hello")
    outs = stream.apply(StreamBatch(opens=[OpenRequest("a"), OpenRequest("a")],
                                    tokens=[TokenBatch("nope", ids), TokenBatch("a", ids)]))
    by_error = {(o.request_id, o.error): o for o in outs}
    assert set(by_error) == {("a", "DUPLICATE_REQUEST_ID"), ("nope", "UNKNOWN_REQUEST"), ("a", "")}
    assert not by_error[("a", "DUPLICATE_REQUEST_ID")].finished   # the first "a" carries on
    assert by_error[("nope", "UNKNOWN_REQUEST")].finished
    assert by_error[("a", "")].text == "Hello"
    outs = stream.apply(StreamBatch(tokens=[TokenBatch("a", [tiny_sp.vocab_size + 5])]))
    assert [(o.request_id, o.error, o.finished) for o in outs] == [("a", "INVALID_TOKEN_ID", True)]
    assert stream.open_requests == 0
    outs = stream.apply(StreamBatch(opens=[OpenRequest("b", prefix_ids=[tiny_sp.vocab_size])]))
    assert [o.error for o in outs] == ["INVALID_TOKEN_ID"]
    outs = stream.apply(StreamBatch(opens=[OpenRequest("c", stop=["x" * (MAX_STOP_CHARS + 1)]),
                                           OpenRequest("d", stop=[str(i) for i in range(MAX_STOPS + 1)])]))
    assert [(o.request_id, o.error, o.finished) for o in outs] == [("c", "INVALID_STOP", True),
                                                                   ("d", "INVALID_STOP", True)]
    assert stream.open_requests == 0


def test_close_drops_state_without_output(tiny_sp: LoadedTokenizer) -> None:
    stream = DetokStream(tiny_sp)
    stream.apply(StreamBatch(opens=[OpenRequest("a", ["never"]), OpenRequest("b")]))
    # "a" holds back "nev" (could become the stop); closing it must not flush that.
    outs = stream.apply(StreamBatch(tokens=[TokenBatch("a", encode(tiny_sp, "x nev"))], closes=["a"]))
    assert [(o.request_id, o.text) for o in outs] == [("a", "x ")]
    assert stream.open_requests == 1
    assert stream.apply(StreamBatch(closes=["a", "zzz"])) == []
    outs = stream.apply(StreamBatch(tokens=[TokenBatch("a", [5])]))
    assert [o.error for o in outs] == ["UNKNOWN_REQUEST"]


def test_open_request_limit(tiny_sp: LoadedTokenizer) -> None:
    stream = DetokStream(tiny_sp, max_requests=2)
    outs = stream.apply(StreamBatch(opens=[OpenRequest(str(i)) for i in range(3)]))
    assert [(o.request_id, o.error) for o in outs] == [("2", "OVERLOADED")]
    stream.apply(StreamBatch(closes=["0"]))
    assert stream.apply(StreamBatch(opens=[OpenRequest("2")])) == []


def test_prefix_and_skip_special_per_request(tiny_sp: LoadedTokenizer) -> None:
    tok = tiny_sp
    prompt = [1, *encode(tok, "Say hi:")]
    gen = [*encode(tok, "Say hi: hi there")[len(prompt) - 1:], 2]
    stream = DetokStream(tok)
    stream.apply(StreamBatch(opens=[OpenRequest("skip", skip_special_tokens=True, prefix_ids=prompt),
                                    OpenRequest("keep", skip_special_tokens=False, prefix_ids=prompt)]))
    outs = stream.apply(StreamBatch(tokens=[TokenBatch("skip", gen, True), TokenBatch("keep", gen, True)]))
    text = {o.request_id: o.text for o in outs}
    assert text["skip"] == tok.decode(prompt + gen, True)[len(tok.decode(prompt, True)):]
    assert text["keep"] == tok.decode(prompt + gen, False)[len(tok.decode(prompt, False)):]
    assert text["skip"] == " hi there" and text["keep"] == " hi there</s>"
