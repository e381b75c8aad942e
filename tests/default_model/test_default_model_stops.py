"""Stop ids from the model's own files (issue 14 item 8): a chat turn ends on the template's
end-of-turn token. Real tokenizer files from tests/artefacts.py (built from installed packages when
../shared/data is absent; a test skips, saying why, only when its artefact cannot be had)."""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest

from services.tokenization.chat_template import CHATML, GEMMA
from services.tokenization.loader import TokenizerFiles, load_tokenizer, template_stop_ids
from tests import artefacts
from tests.tiny_model import build_tokenizer

# Mistral v1's turn format, its end-of-turn written as text (as many community templates do).
MISTRAL_STYLE = ("<s>{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
                 "{% else %}{{ ' ' + m['content'] + '</s>' }}{% endif %}{% endfor %}")


def tokenizer_dir(tmp_path: pathlib.Path, source: pathlib.Path, template: str | None) -> pathlib.Path:
    """A copy of a real tokenizer directory (tokenizer.json + tokenizer_config.json only: no
    generation_config), with `template` as its chat template."""
    out = tmp_path / source.name
    out.mkdir(parents=True)
    shutil.copy(source / "tokenizer.json", out / "tokenizer.json")
    config_file = source / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    config.pop("chat_template", None)
    if template is not None:
        config["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def test_gemma_end_of_turn_comes_from_the_template(tmp_path: pathlib.Path) -> None:
    source = artefacts.path("gemma3")   # Gemma 3's real tokenizer; its files name <eos> only
    plain = load_tokenizer(TokenizerFiles.discover(tokenizer_dir(tmp_path / "a", source, None)))
    chat = load_tokenizer(TokenizerFiles.discover(tokenizer_dir(tmp_path / "b", source, GEMMA)))
    end_of_turn = chat.tokenizer.token_to_id("<end_of_turn>")
    eos = chat.tokenizer.token_to_id("<eos>")
    assert (eos, end_of_turn) == (1, 106)
    assert plain.eos_token_ids == (eos,)
    assert chat.eos_token_ids == (eos, end_of_turn)


def test_other_turn_formats(tmp_path: pathlib.Path) -> None:
    mistral = artefacts.path("mistral-v1")   # a real tokenizer.json alone: no file names its EOS
    bare = load_tokenizer(TokenizerFiles.discover(tokenizer_dir(tmp_path / "a", mistral, None)))
    loaded = load_tokenizer(TokenizerFiles.discover(tokenizer_dir(tmp_path / "b", mistral, MISTRAL_STYLE)))
    assert bare.eos_token_ids == ()
    assert loaded.eos_token_ids == (loaded.tokenizer.token_to_id("</s>"),) == (2,)
    chatml = tmp_path / "chatml"
    build_tokenizer(chatml)   # ChatML: <|im_end|> ends a turn, </s> ends a document
    loaded = load_tokenizer(TokenizerFiles.discover(chatml))
    ids = {loaded.tokenizer.id_to_token(i) for i in loaded.eos_token_ids}
    assert ids == {"</s>", "<|im_end|>"}
    assert template_stop_ids(loaded.tokenizer, loaded.special_tokens, CHATML) == (
        loaded.tokenizer.token_to_id("<|im_end|>"),)


def test_templates_that_name_no_end_of_turn(tmp_path: pathlib.Path) -> None:
    chatml = tmp_path / "chatml"
    build_tokenizer(chatml)
    tok = load_tokenizer(TokenizerFiles.discover(chatml))
    for source in ("{% for m in messages %}{{ m['content'] }}\n{% endfor %}",       # plain text after it
                   "{{ raise_exception('only one user message') }}",                 # refuses the probe
                   "{% for m in messages %}{{ m['content'] }}{% endfor %}"):         # nothing after it
        assert template_stop_ids(tok.tokenizer, tok.special_tokens, source) == ()


def test_the_default_model_stops_on_end_of_turn() -> None:
    """The directory `tokenrelay up` serves (Gemma 3 270M as built by tokenrelay_tools.default_model):
    what the tokenizer service tells the router to stop on."""
    model = artefacts.path("gemma-3-270m")
    loaded = load_tokenizer(TokenizerFiles.discover(model))
    assert loaded.eos_token_ids == (1, 106)
    assert [loaded.tokenizer.id_to_token(i) for i in loaded.eos_token_ids] == ["<eos>", "<end_of_turn>"]


async def test_the_engine_ends_the_reply_on_the_template_end_of_turn(tmp_path: pathlib.Path) -> None:
    """Loader to engine: a model whose generation_config names only </s> (as a base model's does)
    and that answers with <|im_end|> at once; the stop ids the loader derives end the reply there,
    the generation_config's alone would not."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import torch
    from transformers import AutoModelForCausalLM

    from engine_svc.backends.base import FinishReason
    from engine_svc.backends.hf import HfBackend, HfConfig
    from tests.engine.engine_testkit import Collector, req
    from tests.tiny_model import build_model
    from tests.waiting import poll

    model_dir = build_model(tmp_path / "chat-model")
    loaded = load_tokenizer(TokenizerFiles.discover(model_dir))
    end_of_turn = loaded.tokenizer.token_to_id("<|im_end|>")
    prompt = loaded.tokenizer.encode("<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n",
                                     add_special_tokens=False).ids
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():   # untie the output layer and point <|im_end|>'s row at this prompt's last state
        hidden = model(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0, -1]
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
        model.lm_head.weight[end_of_turn] = 1000 * hidden / hidden.norm()
    model.save_pretrained(model_dir)
    assert json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"] == 1
    assert end_of_turn in loaded.eos_token_ids
    backend = HfBackend(HfConfig(model=str(model_dir), num_blocks=16, block_size=16, threads=1))
    await backend.start()
    try:
        events = Collector()
        backend.submit(req("stops", prompt, 8, eos_token_ids=list(loaded.eos_token_ids)), events)
        backend.submit(req("runs-on", prompt, 8, eos_token_ids=[1]), events)
        await poll(lambda: all(n in events.events and events.last(n).finished for n in ("stops", "runs-on")),
                   timeout=60, what="both replies")
    finally:
        await backend.close()
    assert events.tokens("stops") == [end_of_turn] and events.last("stops").finish_reason is FinishReason.STOP
    assert len(events.tokens("runs-on")) == 8 and events.last("runs-on").finish_reason is FinishReason.LENGTH
