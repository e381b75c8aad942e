"""Fixtures shared by the router's tests."""

from __future__ import annotations

import pytest

from router_svc.local_detok import LocalDetokenize, load_files
from tokenrelay_tools.cli.byte_tokenizer import ensure_byte_tokenizer


@pytest.fixture(scope="module")
def local(tmp_path_factory) -> LocalDetokenize:
    """The router's own (de)tokenizer over the byte-level tokenizer of `up --engine sim`."""
    return LocalDetokenize(load_files(str(ensure_byte_tokenizer(tmp_path_factory.mktemp("bt")))))
