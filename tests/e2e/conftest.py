"""A whole mesh started with `tokenrelay up` as real processes, once per module."""

from __future__ import annotations

import os
import pathlib

import pytest

from tests import artefacts
from tests.meshkit import start_mesh, stop_mesh
from tests.tiny_model import build_model


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """stories260K when ../shared/data has it, else a tiny random Llama built here."""
    stories = artefacts.optional("stories260K")
    if stories is not None and os.environ.get("TOKENRELAY_TEST_TINY") != "1":
        return stories
    return build_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def hf_mesh(tmp_path_factory: pytest.TempPathFactory, model_dir: pathlib.Path):
    mesh = start_mesh(tmp_path_factory.mktemp("hfmesh"), model_dir, "hf", "--max-in-flight", "3",
                      "--tokenizer-arg=--chat-template=chatml")
    yield mesh
    assert stop_mesh(mesh) == 0, mesh.log.read_text()[-3000:]
