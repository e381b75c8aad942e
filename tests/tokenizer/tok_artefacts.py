"""Tiny tokenizers built in the test run (no downloads, no ../shared/data), and shared sample text.

* a byte-level BPE (GPT-2 style) trained on the sample text, with ChatML tokens and template;
* a SentencePiece-style BPE with byte fallback (Llama style: Metaspace "▁", <0xXX> byte pieces,
  Strip decoder), trained with a deliberately small alphabet so CJK and emoji go through bytes,
  with a Llama-2 chat template that handles a system prompt.
"""

from __future__ import annotations

import json
import pathlib

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SAMPLES = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "Accents: café, naïve, résumé, Ångström, façade, São Paulo, Zürich.",
    "CJK: 中文字符测试，日本語のテキスト、한국어 텍스트.",
    "Emoji: 👩‍👩‍👧‍👦 family, 🏳️‍🌈 flag, 👍🏽 thumbs, 🤖🧠🫠 and 🇫🇷.",
    "Combining marks: e\u0301 a\u0308 n\u0303 Z̤͔ͧ̑̓ä͖̭̈̇lͮ̒ͫǧ̗͚̚o̙̔ͮ̇͐̇.",
    "Right-to-left: مرحبا بالعالم and שלום עולם, mixed with English.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n\treturn fibonacci(n - 1) + fibonacci(n - 2)\n",
    "    leading spaces, trailing spaces   \n\n\nnewlines\r\nand tabs\t\tend",
    "Math: ∀x∈ℝ, x² ≥ 0; 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕥𝕖𝕩𝕥; zero\u200bwidth, nb\u00a0sp, a literal \ufffd replacement.",
]
TEXT = "\n".join(SAMPLES)
CORPUS = [*SAMPLES, *(TEXT.split(" ")), "the cat sat on the mat " * 20, "public static void main() {}"] * 3

CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# The classic Llama-2 chat template (system prompt folded into the first user turn).
LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}"
    "{% endfor %}"
)


def _write(directory: pathlib.Path, name: str, data: object) -> None:
    (directory / name).write_text(json.dumps(data, ensure_ascii=False, indent=1), encoding="utf-8")


def build_bytelevel(directory: pathlib.Path, *, chat_template: str | None = CHATML_TEMPLATE) -> pathlib.Path:
    directory.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(directory / "tokenizer.json"))
    config: dict[str, object] = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                                 "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 2048}
    if chat_template is not None:
        config["chat_template"] = chat_template
    _write(directory, "tokenizer_config.json", config)
    _write(directory, "generation_config.json", {"eos_token_id": [2, 0]})
    return directory


def build_sentencepiece(directory: pathlib.Path, *, chat_template: str | None = LLAMA2_TEMPLATE) -> pathlib.Path:
    """BPE with byte fallback, assembled the way Llama's tokenizer.json is laid out."""
    directory.mkdir(parents=True, exist_ok=True)
    specials = ["<unk>", "<s>", "</s>"]
    base = Tokenizer(models.BPE())
    # Train on words (as SentencePiece does), then serve unsplit like Llama's tokenizer.json.
    base.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    trainer = trainers.BpeTrainer(vocab_size=500, limit_alphabet=70, special_tokens=specials, show_progress=False)
    base.train_from_iterator(CORPUS, trainer)
    trained = json.loads(base.to_str())["model"]
    vocab = {t: i for i, t in enumerate(specials)}
    vocab.update({f"<0x{b:02X}>": len(specials) + b for b in range(256)})
    for piece, _ in sorted(trained["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(piece, len(vocab))
    spec = json.loads(base.to_str())
    spec["added_tokens"] = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                             "normalized": False, "special": True} for i, t in enumerate(specials)]
    spec["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": False}
    spec["model"] = {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                     "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True,
                     "ignore_merges": False, "vocab": vocab, "merges": trained["merges"]}
    spec["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "ByteFallback"},
        {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                 {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}}
    Tokenizer.from_str(json.dumps(spec)).save(str(directory / "tokenizer.json"))
    config: dict[str, object] = {
        "bos_token": {"content": "<s>", "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "__type": "AddedToken"},
        "eos_token": "</s>", "unk_token": "<unk>", "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 1000000000000000019884624838656,
        "added_tokens_decoder": {str(i): {"content": t, "special": True} for i, t in enumerate(specials)}}
    if chat_template is not None:
        config["chat_template"] = chat_template
    _write(directory, "tokenizer_config.json", config)
    _write(directory, "config.json", {"model_type": "llama", "max_position_embeddings": 4096,
                                      "bos_token_id": 1, "eos_token_id": 2})
    _write(directory, "generation_config.json", {"bos_token_id": 1, "eos_token_id": [2, 258]})
    return directory
