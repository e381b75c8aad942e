"""A tokenizer that covers a random-weights model's whole vocabulary, for the GPU mesh run.

The router detokenizes every id the engine emits, so the tokenizer service needs a tokenizer.json
whose vocabulary holds every id of the model (Llama 3: 128,256) — and the random-weights model
dir has only config.json. This writes one next to it, built with the `tokenizers` library:

- a WordPiece model (greedy longest match, ``##`` continuations); id ``i`` is the word ``t{i}``
  for every id that is not one of the few below, so any random id decodes to readable text
  (``t5 t77 t1024``) and a space-separated ``t{i}`` text encodes back to exactly those ids;
- the words of the load generator's filler prose (tokenrelay_tools/bench/prompts.py) and every
  printable ASCII character (alone and as a ``##`` continuation), so a text prompt (the bench's
  mesh target) is tokenized into ordinary words, and its hex nonce into one token per character
  — different sessions then differ from their first token on, and no prefix cache can match
  across them;
- BOS / EOS at the config's ids (added special tokens), so the tokenizer reports the model's stop ids.

    python bench/gpu/make_vocab_tokenizer.py /tmp/llama8b          # reads config.json there
    python bench/gpu/make_vocab_tokenizer.py DIR --vocab-size 128256 --check
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import string
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent.parent))


def _filler_words() -> list[str]:
    try:
        from tokenrelay_tools.bench.prompts import FILLER
    except ImportError:   # the load generator is not importable: ids still cover the vocabulary
        return []
    from tokenizers.pre_tokenizers import Whitespace

    return [w for w, _ in Whitespace().pre_tokenize_str(FILLER)]


def build(vocab_size: int, bos: int | None, eos: int | None) -> tuple[object, dict[str, object]]:
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

    special = {i: name for i, name in ((bos, "<|begin_of_text|>"), (eos, "<|end_of_text|>")) if i is not None}
    if any(not 0 <= i < vocab_size for i in special):
        raise SystemExit(f"BOS/EOS ids {sorted(special)} are outside the vocabulary of {vocab_size}")
    words = ["[UNK]"]
    chars = [c for c in string.printable if not c.isspace()]
    words += chars + ["##" + c for c in chars]
    words += sorted(set(_filler_words()) - set(words))
    vocab: dict[str, int] = {}
    free = (i for i in range(vocab_size) if i not in special)
    for word in words:
        vocab[word] = next(free)
    for i in free:   # every other id is the word t{i}: unique, and it decodes to text
        vocab[f"t{i}"] = i
    for i, name in special.items():
        vocab[name] = i
    if len(vocab) != vocab_size:
        raise SystemExit(f"vocabulary too small for the fixed words ({vocab_size})")
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]", max_input_chars_per_word=100))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok.add_special_tokens([AddedToken(name, special=True, normalized=False) for name in special.values()])
    config: dict[str, object] = {
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1_000_000, "unk_token": "[UNK]",
        "bos_token": special.get(bos) if bos is not None else None,
        "eos_token": special.get(eos) if eos is not None else None,
        "added_tokens_decoder": {str(i): {"content": name, "special": True, "normalized": False, "lstrip": False,
                                          "rstrip": False, "single_word": False} for i, name in special.items()}}
    return tok, config


def check(directory: pathlib.Path, vocab_size: int) -> None:
    """Every id decodes, `t{i}` text encodes back to those ids, filler text is words (few [UNK])."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
    rng = random.Random(0)
    ids = [rng.randrange(vocab_size) for _ in range(4096)] + [0, vocab_size - 1]
    text = tok.decode(ids, skip_special_tokens=False)
    assert text, "empty decode"
    plain = [i for i in ids if (name := tok.id_to_token(i) or "").startswith("t") and name[1:].isdigit()]
    back = tok.encode(" ".join(f"t{i}" for i in plain), add_special_tokens=False).ids
    assert back == plain, "t{i} text does not encode back to its ids"
    for i in range(vocab_size):
        assert tok.id_to_token(i) is not None, f"id {i} has no token"
    sample = "[0123456789ab] The harbour town woke slowly that spring morning."
    enc = tok.encode(sample, add_special_tokens=False)
    unk = enc.ids.count(tok.token_to_id("[UNK]") or 0)
    print(f"check ok: vocab {vocab_size}, 4098 random ids decode to {len(text)} chars; "
          f"{sample!r} -> {len(enc.ids)} tokens ({unk} unknown): {enc.tokens[:16]}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir", help="the model directory (its config.json gives vocab_size, BOS and EOS)")
    p.add_argument("--vocab-size", type=int, default=0, help="override config.json's vocab_size")
    p.add_argument("--check", action="store_true", help="load the written tokenizer back and check it")
    a = p.parse_args()
    directory = pathlib.Path(a.model_dir)
    config = json.loads((directory / "config.json").read_text())
    vocab_size = a.vocab_size or int(config["vocab_size"])

    def one(key: str) -> int | None:
        value = config.get(key)
        return int(value[0] if isinstance(value, list) else value) if value is not None else None

    tok, tok_config = build(vocab_size, one("bos_token_id"), one("eos_token_id"))
    tok.save(str(directory / "tokenizer.json"))  # type: ignore[attr-defined]
    (directory / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=1) + "\n")
    print(f"wrote {directory / 'tokenizer.json'} ({vocab_size} ids)")
    if a.check:
        check(directory, vocab_size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
