"""Fixtures for tokenizer_svc tests: tiny tokenizers built here, real ones from tests/artefacts.py
(../shared/data when present, else built from installed packages)."""

from __future__ import annotations

import pathlib
import sys

import pytest

# The helpers next to this file, and the repo root for an install made before tokenizer_svc existed.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from tok_artefacts import build_bytelevel, build_sentencepiece

from services.tokenization.loader import LoadedTokenizer, TokenizerFiles, load_tokenizer
from tests import artefacts

TINY = ("tiny-bytelevel", "tiny-sentencepiece")
# Roles or names in tests/artefacts.py: GPT-2 or tekken (byte-level BPE), Llama 2 or Gemma 3 (SentencePiece-style
# BPE with byte fallback), and Mistral v1 (from ../shared/data or the mistral-common wheel).
REAL = ("real-bytelevel", "real-sentencepiece", "mistral-v1")
ALL_TOKENIZERS = (*TINY, *REAL)


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    root = tmp_path_factory.mktemp("tiny-tokenizers")
    return {"tiny-bytelevel": build_bytelevel(root / "bytelevel"),
            "tiny-sentencepiece": build_sentencepiece(root / "sentencepiece")}


_CACHE: dict[str, LoadedTokenizer] = {}


def tokenizer_path(name: str, tiny_dirs: dict[str, pathlib.Path]) -> pathlib.Path:
    if name in tiny_dirs:
        return tiny_dirs[name]
    return artefacts.tokenizer_json(name)


@pytest.fixture(params=ALL_TOKENIZERS)
def any_tokenizer(request: pytest.FixtureRequest, tiny_dirs: dict[str, pathlib.Path]) -> LoadedTokenizer:
    """Each tokenizer in turn: the tiny ones, then the real ones (skipped only where none can be had)."""
    name = request.param
    path = tokenizer_path(name, tiny_dirs)
    key = f"{name}:{path}"
    if key not in _CACHE:
        _CACHE[key] = load_tokenizer(TokenizerFiles.discover(path))
    return _CACHE[key]


@pytest.fixture
def tiny_sp(tiny_dirs: dict[str, pathlib.Path]) -> LoadedTokenizer:
    return load_tokenizer(TokenizerFiles.discover(tiny_dirs["tiny-sentencepiece"]))


@pytest.fixture
def tiny_bl(tiny_dirs: dict[str, pathlib.Path]) -> LoadedTokenizer:
    return load_tokenizer(TokenizerFiles.discover(tiny_dirs["tiny-bytelevel"]))
