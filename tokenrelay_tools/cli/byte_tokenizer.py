"""The tokenizer `tokenrelay up --engine sim` serves when no `--model` is given: byte-level, base install only.

The default model needs torch and the `default-model` extra; the simulated engine needs only a real
tokenizer, so that the mesh still tokenizes prompts and detokenizes the engine's ids into text. This
one is built with the `tokenizers` library (a base dependency): ids 0-255 are the 256 bytes (GPT-2's
byte-to-unicode alphabet, so every string round-trips, UTF-8 and all), then three specials: an
end-of-text token and ChatML's two turn markers, with ChatML as the chat template. It is written
once to the cache (`tokenizer.json`, `tokenizer_config.json`, `generation_config.json`; no
weights, no `config.json`) and reused; a directory from another recipe is rebuilt.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import tempfile

from services.tokenization.chat_template import CHATML

NAME = "byte-level"
EOS = "<|endoftext|>"
TURN_START, TURN_END = "<|im_start|>", "<|im_end|>"
SPECIALS = (EOS, TURN_START, TURN_END)        # ids 256, 257, 258
MAX_CONTEXT = 8192                            # the sim engine's default context
# The ids `up --engine sim` has the sim reply with: printable ASCII (space to "~"), one character per
# token. Replies drawn from every id (bytes that are not UTF-8 on their own, the turn markers) come
# back in the next turn's text as other ids, so the next prompt's prefix-cache hits were lower through
# the mesh than for the engine alone replaying ids (61% against 73% in chat-multiturn): an artefact
# that `tokenrelay bench --compare` counted as time the mesh adds. A real model's replies re-tokenize
# mostly to themselves.
REPLY_IDS = (32, 127)                         # [from, below)
FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
_STAMP = "tokenrelay-build.json"
_RECIPE = 2   # 2: the GPT-2 regex split (bounds the library's per-word cache; same ids)
DESCRIPTION = f"a byte-level tokenizer ({256 + len(SPECIALS)} tokens: 256 bytes + {', '.join(SPECIALS)}; ChatML)"


def byte_alphabet() -> list[str]:
    """The printable character that stands for each byte, in byte order (GPT-2's byte-level scheme:
    printable Latin-1 bytes stand for themselves, the others are shifted past 255)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    keep = set(printable)
    shifted = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(shifted)) for b in range(256)]


def is_built(directory: pathlib.Path) -> bool:
    try:
        stamp = json.loads((directory / _STAMP).read_text())
    except (OSError, ValueError):
        return False
    return stamp.get("recipe") == _RECIPE and all((directory / f).is_file() for f in FILES)


def ensure_byte_tokenizer(cache_root: pathlib.Path) -> pathlib.Path:
    """`<cache_root>/models/byte-level`, written first if absent or from another recipe."""
    target = cache_root / "models" / NAME
    if is_built(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{NAME}.tmp-", dir=target.parent))
    old = target.with_name(f".{NAME}.old-{os.getpid()}")
    try:
        write_byte_tokenizer(tmp)
        tmp.chmod(0o755)
        if target.exists():
            os.replace(target, old)
        try:
            os.replace(tmp, target)
        except OSError:  # another `up` put its copy there first: same recipe, use it
            if not is_built(target):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    return target


def write_byte_tokenizer(directory: pathlib.Path) -> None:
    """Write the tokenizer files into the existing `directory`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: i for i, ch in enumerate(byte_alphabet())}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # With no merges every byte is its own token whatever the split; the regex split is there for the
    # library's BPE cache, which keeps one entry per pre-tokenized word: without it every distinct
    # prompt was one "word" and the tokenizer's memory grew with each (+12% in the 2,000-stream soak).
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    tokenizer.save(str(directory / "tokenizer.json"))
    ids = {t: tokenizer.token_to_id(t) for t in SPECIALS}
    flags = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "pad_token": EOS,
        "model_max_length": MAX_CONTEXT, "chat_template": CHATML, "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {str(i): {"content": t, **flags} for t, i in ids.items()},
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    # A document ends with end-of-text, a chat turn with <|im_end|>: both stop generation.
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [ids[EOS], ids[TURN_END]]}) + "\n")
    (directory / _STAMP).write_text(json.dumps({"recipe": _RECIPE, "name": NAME}) + "\n")
