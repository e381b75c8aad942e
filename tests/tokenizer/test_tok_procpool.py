"""Encoder processes (tokenizer_svc/procpool.py): the same ids as in-process encoding, through the
service too; a child that dies fails only the batch it held and is replaced."""

from __future__ import annotations

import itertools
import os
import pathlib
import signal

import pytest
from tok_artefacts import SAMPLES, TEXT
from tokenizers import Tokenizer

from services.errors import Unavailable
from services.wire import unpack_ids
from tokenizer_svc.procpool import EncodeProcessPool, _chunks


def _texts() -> list[str]:
    return [TEXT, "", *SAMPLES, TEXT * 40, "short one", *(f"prompt {i} " * (i + 1) for i in range(30))]


def test_chunks_cover_every_text_once_in_order() -> None:
    texts = ["x" * n for n in (10, 20000, 5, 5, 9000, 9000, 9000, 1)]
    ranges = sorted(_chunks(texts, 2))
    assert ranges[0][0] == 0 and ranges[-1][1] == len(texts)
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    assert _chunks([], 4) == [] and _chunks(["a"], 4) == [(0, 1)]
    assert len(_chunks(["y" * 100_000] * 16, 4)) == 8          # about two chunks per process


def test_processes_encode_like_the_library(tiny_dirs: dict[str, pathlib.Path]) -> None:
    tok = Tokenizer.from_file(str(tiny_dirs["tiny-sentencepiece"] / "tokenizer.json"))
    pool = EncodeProcessPool(tok.to_str(), 2)
    pool.start()
    try:
        texts = _texts()
        for special in (True, False):
            packed = pool.encode(texts, add_special_tokens=special)
            assert [unpack_ids(p) for p in packed] == [
                e.ids for e in tok.encode_batch_fast(texts, add_special_tokens=special)]
        assert pool.encode([], add_special_tokens=True) == []
    finally:
        pool.close()


def test_a_dead_child_fails_its_batch_and_is_replaced(tiny_dirs: dict[str, pathlib.Path]) -> None:
    tok = Tokenizer.from_file(str(tiny_dirs["tiny-bytelevel"] / "tokenizer.json"))
    pool = EncodeProcessPool(tok.to_str(), 1)
    pool.start()
    try:
        (victim,) = pool.pids()
        os.kill(victim, signal.SIGKILL)
        with pytest.raises(Unavailable) as info:
            pool.encode(["hello there"], add_special_tokens=False)
        assert info.value.reason == "ENCODER_RESTARTED"
        (fresh,) = pool.pids()
        assert fresh != victim
        assert unpack_ids(pool.encode(["hello there"], add_special_tokens=False)[0]) == tok.encode(
            "hello there", add_special_tokens=False).ids
    finally:
        pool.close()
    with pytest.raises(Unavailable):
        pool.encode(["closed"], add_special_tokens=False)
