"""Loading a tokenizer and its metadata from a model directory or explicit paths."""

from __future__ import annotations

import json
import pathlib

import pytest
from tok_artefacts import build_bytelevel
from tokenizers import Tokenizer

from services.tokenization.loader import TokenizerFiles, load_tokenizer
from tests import artefacts


def test_sentencepiece_dir_metadata(tiny_dirs: dict[str, pathlib.Path]) -> None:
    tok = load_tokenizer(TokenizerFiles.discover(tiny_dirs["tiny-sentencepiece"]))
    raw = Tokenizer.from_file(str(tiny_dirs["tiny-sentencepiece"] / "tokenizer.json"))
    assert tok.name == "sentencepiece"
    assert tok.vocab_size == raw.get_vocab_size(with_added_tokens=True)
    assert tok.bos_token_id == raw.token_to_id("<s>")
    # generation_config's list first, then tokenizer_config's eos_token, then config.json; no repeats.
    assert tok.eos_token_ids == (raw.token_to_id("</s>"), 258)
    assert tok.max_context == 4096                      # config.json max_position_embeddings
    assert tok.special_ids == {raw.token_to_id(t) for t in ("<unk>", "<s>", "</s>")}
    assert tok.special_tokens["bos_token"] == "<s>"     # an AddedToken dict in tokenizer_config
    assert "default" in tok.chat_templates
    assert not tok.byte_level


def test_bytelevel_dir_metadata(tiny_dirs: dict[str, pathlib.Path]) -> None:
    tok = load_tokenizer(TokenizerFiles.discover(tiny_dirs["tiny-bytelevel"] / "tokenizer.json"))
    raw = Tokenizer.from_file(str(tiny_dirs["tiny-bytelevel"] / "tokenizer.json"))
    assert tok.bos_token_id is None
    assert tok.eos_token_ids == (raw.token_to_id("<|im_end|>"), raw.token_to_id("<|endoftext|>"))
    assert tok.max_context == 2048                      # tokenizer_config model_max_length (sane)
    assert tok.byte_level
    # Raw bytes of byte-level pieces: "é" is two bytes, each a byte-level character.
    ids = raw.encode("é", add_special_tokens=False).ids
    assert b"".join(tok.token_bytes(i) for i in ids) == "é".encode()


def test_explicit_paths_and_insane_model_max_length(tmp_path: pathlib.Path,
                                                    tiny_dirs: dict[str, pathlib.Path]) -> None:
    cfg = tmp_path / "my_config.json"
    cfg.write_text(json.dumps({"eos_token": "<|endoftext|>", "model_max_length": 1e30,
                               "chat_template": [{"name": "default", "template": "A"},
                                                 {"name": "tool_use", "template": "B"}]}))
    files = TokenizerFiles.discover(tiny_dirs["tiny-bytelevel"] / "tokenizer.json", tokenizer_config=str(cfg))
    tok = load_tokenizer(files)
    assert tok.max_context == 0
    assert tok.chat_templates == {"default": "A", "tool_use": "B"}
    with pytest.raises(FileNotFoundError):
        TokenizerFiles.discover(tmp_path)
    with pytest.raises(FileNotFoundError):
        TokenizerFiles.discover(tiny_dirs["tiny-bytelevel"], model_config=str(tmp_path / "absent.json"))


def test_newer_template_files_win(tmp_path: pathlib.Path) -> None:
    directory = build_bytelevel(tmp_path / "m")
    (directory / "chat_template.jinja").write_text("JINJA FILE")
    (directory / "additional_chat_templates").mkdir()
    (directory / "additional_chat_templates" / "rag.jinja").write_text("RAG")
    tok = load_tokenizer(TokenizerFiles.discover(directory))
    assert tok.chat_templates == {"default": "JINJA FILE", "rag": "RAG"}


def test_padding_and_truncation_are_switched_off(tmp_path: pathlib.Path) -> None:
    directory = build_bytelevel(tmp_path / "m")
    raw = Tokenizer.from_file(str(directory / "tokenizer.json"))
    raw.enable_padding(length=64, pad_id=0)
    raw.enable_truncation(4)
    raw.save(str(directory / "tokenizer.json"))
    tok = load_tokenizer(TokenizerFiles.discover(directory))
    encodings = tok.tokenizer.encode_batch_fast(["a", "a much longer text than four tokens"])
    assert len(encodings[0].ids) < 4 and len(encodings[1].ids) > 4


def test_tokens_declared_only_in_tokenizer_config_are_added(tmp_path: pathlib.Path) -> None:
    directory = build_bytelevel(tmp_path / "m")
    config = json.loads((directory / "tokenizer_config.json").read_text())
    raw = Tokenizer.from_file(str(directory / "tokenizer.json"))
    new_id = raw.get_vocab_size(with_added_tokens=True)
    config["added_tokens_decoder"] = {str(new_id): {"content": "<tool_call>", "special": True}}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(TokenizerFiles.discover(directory))
    assert tok.tokenizer.token_to_id("<tool_call>") == new_id
    assert new_id in tok.special_ids
    assert tok.tokenizer.encode("x<tool_call>y", add_special_tokens=False).ids.count(new_id) == 1


# A real model directory's metadata: stories260K (../shared/data), else Gemma 3 270M (built from its package).
REAL_MODEL_METADATA = {
    "stories260K": (("stories260K", 512, 1, (2,), 512), set(), {0, 1, 2}),
    "gemma-3-270m": (("gemma-3-270m", 262144, 2, (1, 106), 32768), {"default"}, {0, 1, 2, 106}),
}


def test_real_model_metadata() -> None:
    name, directory = artefacts.resolve("real-model")
    tok = load_tokenizer(TokenizerFiles.discover(directory))
    expected, templates, specials = REAL_MODEL_METADATA[name]
    assert (tok.name, tok.vocab_size, tok.bos_token_id, tok.eos_token_ids, tok.max_context) == expected
    assert set(tok.chat_templates) == templates
    assert specials <= tok.special_ids


def test_a_chat_template_override_adds_its_end_of_turn_to_the_stop_ids(tmp_path) -> None:
    from tokenizers import Tokenizer

    from tests.tokenizer.tok_artefacts import build_bytelevel
    from tokenizer_svc.app import load_domain
    from tokenizer_svc.config import TokenizerSettings

    directory = build_bytelevel(tmp_path / "tok", chat_template=None)
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tok.add_special_tokens(["<start_of_turn>", "<end_of_turn>"])
    tok.save(str(directory / "tokenizer.json"))
    end_of_turn = tok.token_to_id("<end_of_turn>")
    plain, _ = load_domain(TokenizerSettings(tokenizer=str(directory)))
    assert end_of_turn not in plain.eos_token_ids
    served, template = load_domain(TokenizerSettings(tokenizer=str(directory), chat_template="gemma"))
    assert template is not None and end_of_turn in served.eos_token_ids
    assert set(plain.eos_token_ids) < set(served.eos_token_ids)
