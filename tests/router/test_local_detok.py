"""`LocalDetokenize` (router_svc/local_detok.py) with the byte-level tokenizer: the port's contract
(outputs merged while not taken, a failure as a marker, state dropped on close) and the start
check that refuses another tokenizer."""

from __future__ import annotations

import pytest

from router_svc.local_detok import PROBE, LocalDetokenize, load_local, mismatch
from router_svc.types import DetokOut, TokenizerMeta
from services.errors import Reason
from services.mux import StreamBroken
from tokenrelay_tools.cli.byte_tokenizer import ensure_byte_tokenizer


@pytest.fixture(scope="module")
def local(tmp_path_factory) -> LocalDetokenize:
    return load_local(str(ensure_byte_tokenizer(tmp_path_factory.mktemp("bt"))))


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
    first.send([local.tokenizer.vocab_size + 5], final=False)
    (bad,) = await first.next_ready()
    assert bad.error == Reason.INVALID_TOKEN_ID and bad.finished
    first.close(flushed=False)
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
