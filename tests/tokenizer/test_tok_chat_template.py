"""Chat templates: ids equal to transformers' apply_chat_template; overrides; errors; sandbox."""

from __future__ import annotations

import functools
import json
import pathlib
from typing import Any

import pytest
from tok_artefacts import CHATML_TEMPLATE, LLAMA2_TEMPLATE, build_bytelevel

from services.errors import InvalidArgument
from services.tokenization.chat_template import BUILTIN_TEMPLATES, ChatTemplate, ChatTemplateNotFound, resolve_template
from services.tokenization.loader import LoadedTokenizer, TokenizerFiles, load_tokenizer
from tests import artefacts

transformers = pytest.importorskip("transformers")

CHATS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi 👋, café?"},
     {"role": "assistant", "content": "  Bonjour — 你好  "}, {"role": "user", "content": "RTL: שלום\n\tcode"}],
    [{"role": "user", "content": "text with <s> and </s> and <|im_end|> inside"},
     {"role": "assistant", "content": "ok"}, {"role": "user", "content": ""}],
]


def ours(tok: LoadedTokenizer, template: ChatTemplate, chat: list[dict[str, str]], gen: bool) -> list[int]:
    text = template.render(chat, add_generation_prompt=gen)
    return tok.tokenizer.encode(text, add_special_tokens=False).ids


@functools.lru_cache(maxsize=8)
def hf_tokenizer(directory: pathlib.Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(str(directory))


def theirs(directory: pathlib.Path, chat: list[dict[str, str]], gen: bool) -> list[int]:
    hf = hf_tokenizer(directory)
    return list(hf.apply_chat_template(chat, add_generation_prompt=gen, tokenize=True, return_dict=False))


def load_with_template(directory: pathlib.Path, override: str = "") -> tuple[LoadedTokenizer, ChatTemplate]:
    tok = load_tokenizer(TokenizerFiles.discover(directory))
    chosen = resolve_template(override, tok.chat_templates)
    assert chosen is not None
    return tok, ChatTemplate(chosen[1], chosen[0], tok.special_tokens)


def model_dir(tmp_path: pathlib.Path, tokenizer_json: pathlib.Path, template: str, **config: object) -> pathlib.Path:
    directory = tmp_path / tokenizer_json.parent.name
    directory.mkdir()
    (directory / "tokenizer.json").write_bytes(tokenizer_json.read_bytes())
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template, **config}))
    return directory


@pytest.mark.parametrize("name", ["tiny-bytelevel", "tiny-sentencepiece"])
def test_equal_to_transformers_on_tiny_tokenizers(name: str, tiny_dirs: dict[str, pathlib.Path]) -> None:
    tok, template = load_with_template(tiny_dirs[name])
    for chat in CHATS:
        for gen in (True, False):
            assert ours(tok, template, chat, gen) == theirs(tiny_dirs[name], chat, gen)


def test_equal_to_transformers_llama2_real_tokenizer(tmp_path: pathlib.Path) -> None:
    # Llama 2's own tokenizer, else Mistral v1's (the same SentencePiece layout and <s> </s> <unk>).
    directory = model_dir(tmp_path, artefacts.tokenizer_json("llama-style"), LLAMA2_TEMPLATE,
                          bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tok, template = load_with_template(directory)
    for chat in CHATS:
        assert ours(tok, template, chat, False) == theirs(directory, chat, False)


def test_equal_to_transformers_chatml_on_gpt2(tmp_path: pathlib.Path) -> None:
    # GPT-2's byte-level BPE, else Mistral NeMo's (tekken): ChatML's markers are plain text to both.
    name, found = artefacts.resolve("real-bytelevel")
    directory = model_dir(tmp_path, found / "tokenizer.json", CHATML_TEMPLATE,
                          eos_token="<|endoftext|>" if name == "gpt2" else "</s>")
    tok, template = load_with_template(directory)
    for chat in CHATS:
        for gen in (True, False):
            assert ours(tok, template, chat, gen) == theirs(directory, chat, gen)


def test_builtin_gemma_equals_transformers_with_the_same_template(tmp_path: pathlib.Path) -> None:
    directory = build_bytelevel(tmp_path / "gemma-like", chat_template=BUILTIN_TEMPLATES["gemma"])
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["bos_token"] = "<|endoftext|>"
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    tok, template = load_with_template(directory)
    chat = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": " Hi "},
            {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}]
    assert ours(tok, template, chat, True) == theirs(directory, chat, True)
    assert template.render(chat, add_generation_prompt=True) == (
        "<|endoftext|><start_of_turn>user\nBe kind.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello<end_of_turn>\n"
        "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")


def test_builtin_chatml_override(tiny_dirs: dict[str, pathlib.Path]) -> None:
    _, template = load_with_template(tiny_dirs["tiny-sentencepiece"], "chatml")
    assert template.name == "chatml"
    assert template.render([{"role": "user", "content": "x"}], add_generation_prompt=True) == (
        "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n")


def test_resolve_order(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text("FROM FILE")
    model = {"default": "MODEL DEFAULT", "chatml": "MODEL CHATML"}
    assert resolve_template("", model) == ("default", "MODEL DEFAULT")
    assert resolve_template(str(path), model) == (str(path), "FROM FILE")
    assert resolve_template("chatml", model) == ("chatml", "MODEL CHATML")   # the model's own first
    assert resolve_template("gemma", model) == ("gemma", BUILTIN_TEMPLATES["gemma"])
    assert resolve_template("", {"tool_use": "X"}) is None                    # no default, as transformers
    with pytest.raises(ChatTemplateNotFound):
        resolve_template("no-such-template", model)


@pytest.mark.parametrize("source, reason_text", [
    (LLAMA2_TEMPLATE, "alternate"),                                   # raise_exception
    ("{{ ''.__class__.__mro__ }}", "unsafe"),                          # sandbox
    ("{{ messages[0]['content'] + 1 }}", "TypeError"),                 # a bug in the template
    ("{% set ns = namespace(_x=1) %}", "not allowed"),                 # transformers' safe namespace
])
def test_template_errors_are_chat_template_error(source: str, reason_text: str) -> None:
    template = ChatTemplate(source, "t", {"bos_token": "<s>", "eos_token": "</s>"})
    chat = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(InvalidArgument) as info:
        template.render(chat, add_generation_prompt=False)
    assert info.value.reason == "CHAT_TEMPLATE_ERROR"
    assert reason_text in info.value.message


def test_template_helpers() -> None:
    source = ("{{ messages | tojson }}|{{ strftime_now('%Y') | length }}|{% for m in messages %}"
              "{% if loop.index > 1 %}{% break %}{% endif %}{% generation %}{{ m.content }}{% endgeneration %}"
              "{% endfor %}|{{ dict(a=1) | tojson }}")
    out = ChatTemplate(source).render([{"role": "user", "content": "é<>"}, {"role": "x", "content": "y"}], False)
    assert out == '[{"role": "user", "content": "é<>"}, {"role": "x", "content": "y"}]|4|é<>|{"a": 1}'


def test_empty_chat_is_rejected() -> None:
    with pytest.raises(InvalidArgument) as info:
        ChatTemplate(CHATML_TEMPLATE).render([], add_generation_prompt=True)
    assert info.value.reason == "EMPTY_PROMPT"
