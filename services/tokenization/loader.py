"""Load a Hugging Face tokenizer and the metadata around it from a model directory.

Reads `tokenizer.json` (required) plus, when present, `tokenizer_config.json` (special tokens,
`added_tokens_decoder`, chat template: a string or a list of named templates),
`special_tokens_map.json`, `chat_template.jinja` / `chat_template.json` /
`additional_chat_templates/*.jinja` (transformers' newer layout), `generation_config.json`
(EOS ids, possibly a list) and `config.json` (context length, EOS/BOS ids). The result is a
`LoadedTokenizer`: the `tokenizers.Tokenizer` plus everything Info and the chat template need.

Stop ids (`eos_token_ids`) come from the model's own files: generation_config's `eos_token_id`
(a list for chat models: Llama 3's `<|eot_id|>`, Gemma's `<end_of_turn>`), the tokenizer's
`eos_token`, config.json's, and the end-of-turn token of the chat template, found by rendering
one assistant turn and reading the special token the template writes right after its content
(`<end_of_turn>`, `<|im_end|>`, `<|eot_id|>`, `</s>`). The last matters for a directory whose
generation_config predates the template (a base model given a chat template): without it a chat
reply runs on past its turn into an invented next one ("user ...") until max_tokens.
"""

from __future__ import annotations

import json
import pathlib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tokenizers import AddedToken, Tokenizer

from services.errors import TokenrelayError
from services.logging import get_logger

log = get_logger(__name__)

SPECIAL_TOKEN_ATTRIBUTES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                            "cls_token", "mask_token")
# transformers writes 1e30 as model_max_length when the real limit is unknown.
_SANE_MAX_LENGTH = 10_000_000
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@dataclass(frozen=True)
class TokenizerFiles:
    """Where each file comes from; only `tokenizer_json` is required."""

    tokenizer_json: pathlib.Path
    tokenizer_config: pathlib.Path | None = None
    generation_config: pathlib.Path | None = None
    model_config: pathlib.Path | None = None
    special_tokens_map: pathlib.Path | None = None
    template_dir: pathlib.Path | None = None   # where chat_template.jinja & co. are looked for

    @classmethod
    def discover(cls, path: str | pathlib.Path, *, tokenizer_config: str = "", generation_config: str = "",
                 model_config: str = "") -> TokenizerFiles:
        """`path` is a model directory or a tokenizer.json; siblings fill what is not given."""
        path = pathlib.Path(path).expanduser()
        if path.is_dir():
            directory, tok = path, path / "tokenizer.json"
        else:
            directory, tok = path.parent, path
        if not tok.is_file():
            raise FileNotFoundError(f"no tokenizer.json at {tok}")

        def pick(explicit: str, name: str) -> pathlib.Path | None:
            if explicit:
                p = pathlib.Path(explicit).expanduser()
                if not p.is_file():
                    raise FileNotFoundError(f"{p} does not exist")
                return p
            candidate = directory / name
            return candidate if candidate.is_file() else None

        return cls(tokenizer_json=tok,
                   tokenizer_config=pick(tokenizer_config, "tokenizer_config.json"),
                   generation_config=pick(generation_config, "generation_config.json"),
                   model_config=pick(model_config, "config.json"),
                   special_tokens_map=pick("", "special_tokens_map.json"),
                   template_dir=directory)


@dataclass
class LoadedTokenizer:
    """A tokenizer and its metadata. Thread-safe for encode/decode (the Rust object is)."""

    tokenizer: Tokenizer
    name: str
    vocab_size: int
    special_tokens: dict[str, str]            # bos_token, eos_token, ... as the chat template sees them
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    max_context: int                           # 0 = unknown
    special_ids: frozenset[int]
    chat_templates: dict[str, str] = field(default_factory=dict)   # "default" is the main one
    byte_level: bool = False                   # GPT-2 style byte-to-unicode vocabulary

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes a token stands for (used to find UTF-8 character boundaries)."""
        piece = self.tokenizer.id_to_token(token_id)
        if piece is None:
            return b""
        match = _BYTE_TOKEN.fullmatch(piece)
        if match:
            return bytes([int(match.group(1), 16)])
        if self.byte_level:
            table = _byte_decoder()
            if all(ch in table for ch in piece):
                return bytes(table[ch] for ch in piece)
        return piece.replace("▁", " ").encode("utf-8")


def load_tokenizer(files: TokenizerFiles) -> LoadedTokenizer:
    """Raises OSError for missing files and ValueError for ones that do not parse."""
    try:
        tok = Tokenizer.from_file(str(files.tokenizer_json))
    except Exception as exc:  # the Rust side raises a bare Exception for a bad file
        raise ValueError(f"{files.tokenizer_json}: not a tokenizer.json: {exc}") from exc
    # A tokenizer.json saved with padding/truncation would silently pad or cut batched prompts.
    tok.no_padding()
    tok.no_truncation()
    tok_config = _read_json(files.tokenizer_config)
    gen_config = _read_json(files.generation_config)
    model_config = _read_json(files.model_config)
    special_map = _read_json(files.special_tokens_map)

    _add_missing_tokens(tok, tok_config.get("added_tokens_decoder") or {})
    special_tokens = {**_token_strings(special_map), **_token_strings(tok_config)}
    vocab_size = tok.get_vocab_size(with_added_tokens=True)

    def token_id(attr: str) -> int | None:
        text = special_tokens.get(attr)
        return tok.token_to_id(text) if text else None

    bos = token_id("bos_token")
    if bos is None:
        bos = _first_id(gen_config.get("bos_token_id"), _model_value(model_config, "bos_token_id"))
    eos = _unique(_as_ids(gen_config.get("eos_token_id")) + _opt_list(token_id("eos_token"))
                  + _as_ids(_model_value(model_config, "eos_token_id")))
    special_ids = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    special_ids.update(i for attr in SPECIAL_TOKEN_ATTRIBUTES if (i := token_id(attr)) is not None)
    chat_templates = _chat_templates(files, tok_config)
    if "default" in chat_templates:
        eos = _unique([*eos, *template_stop_ids(tok, special_tokens, chat_templates["default"])])
    raw = json.loads(tok.to_str())
    loaded = LoadedTokenizer(
        tokenizer=tok,
        name=files.tokenizer_json.resolve().parent.name,
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        bos_token_id=bos if bos is not None and 0 <= bos < vocab_size else None,
        eos_token_ids=tuple(i for i in eos if 0 <= i < vocab_size),
        max_context=_max_context(model_config, tok_config),
        special_ids=frozenset(special_ids),
        chat_templates=chat_templates,
        byte_level=_mentions_type(raw.get("decoder"), "ByteLevel"),
    )
    log.info("tokenizer_loaded", name=loaded.name, vocab_size=vocab_size, eos=list(loaded.eos_token_ids),
             bos=loaded.bos_token_id, max_context=loaded.max_context,
             chat_templates=sorted(loaded.chat_templates))
    return loaded


_TURN_MARKER = "tokenrelay-end-of-turn-probe"


def template_stop_ids(tok: Tokenizer, special_tokens: Mapping[str, str], source: str) -> tuple[int, ...]:
    """The id of the special token a chat template writes right after an assistant turn's content
    (its end-of-turn), or () when it writes none or the template cannot render such a turn.

    The template is rendered, not pattern-matched, so any turn format works: the text after the
    assistant's content is matched against the tokenizer's special tokens, longest first."""
    from services.tokenization.chat_template import ChatTemplate  # jinja2: only when there is a template

    try:
        rendered = ChatTemplate(source, "probe", special_tokens).render(
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _TURN_MARKER}],
            add_generation_prompt=False)
    except (ValueError, TokenrelayError):  # it does not compile, or refuses this conversation
        return ()
    _, found, after = rendered.rpartition(_TURN_MARKER)
    after = after.lstrip()
    if not found or not after:
        return ()
    specials = {t.content: i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    specials.update({text: i for text in special_tokens.values() if (i := tok.token_to_id(text)) is not None})
    for text in sorted(specials, key=len, reverse=True):
        if text and after.startswith(text):
            return (specials[text],)
    return ()


def _read_json(path: pathlib.Path | None) -> dict[str, Any]:
    if path is None:
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str | None:
    # Special tokens are saved either as plain strings or as serialised AddedToken dicts.
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _token_strings(config: Mapping[str, Any]) -> dict[str, str]:
    return {attr: text for attr in SPECIAL_TOKEN_ATTRIBUTES if (text := _token_text(config.get(attr)))}


def _add_missing_tokens(tok: Tokenizer, decoder: Mapping[str, Any]) -> None:
    """Register tokens that tokenizer_config declares but tokenizer.json lacks (as transformers does)."""
    for key, spec in sorted(decoder.items(), key=lambda kv: int(kv[0])):
        content = _token_text(spec)
        if not content or tok.token_to_id(content) is not None:
            continue
        added = AddedToken(content, special=bool(spec.get("special")), normalized=bool(spec.get("normalized")),
                           lstrip=bool(spec.get("lstrip")), rstrip=bool(spec.get("rstrip")),
                           single_word=bool(spec.get("single_word")))
        tok.add_tokens([added])
        if tok.token_to_id(content) != int(key):
            log.warning("added_token_id_mismatch", token=content, declared=int(key),
                        actual=tok.token_to_id(content))


def _as_ids(value: Any) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _opt_list(value: int | None) -> list[int]:
    return [] if value is None else [value]


def _first_id(*values: Any) -> int | None:
    for value in values:
        ids = _as_ids(value)
        if ids:
            return ids[0]
    return None


def _unique(ids: Iterable[int]) -> list[int]:
    return list(dict.fromkeys(ids))


def _model_value(config: Mapping[str, Any], key: str) -> Any:
    # Multimodal configs (e.g. Gemma 3) keep the language model's values under text_config.
    if key in config:
        return config[key]
    text_config = config.get("text_config")
    return text_config.get(key) if isinstance(text_config, Mapping) else None


def _max_context(model_config: Mapping[str, Any], tok_config: Mapping[str, Any]) -> int:
    for key in _CONTEXT_KEYS:
        value = _model_value(model_config, key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    value = tok_config.get("model_max_length")
    if isinstance(value, (int, float)) and 0 < value < _SANE_MAX_LENGTH:
        return int(value)
    return 0


def _chat_templates(files: TokenizerFiles, tok_config: Mapping[str, Any]) -> dict[str, str]:
    """Named templates, "default" first; newer standalone files win over tokenizer_config's copy."""
    templates: dict[str, str] = {}
    value = tok_config.get("chat_template")
    if isinstance(value, str):
        templates["default"] = value
    elif isinstance(value, list):
        for item in value:
            if isinstance(item, Mapping) and isinstance(item.get("template"), str):
                templates[str(item.get("name", "default"))] = item["template"]
    directory = files.template_dir
    if directory is not None:
        json_file = directory / "chat_template.json"
        if json_file.is_file():
            data = _read_json(json_file)
            if isinstance(data.get("chat_template"), str):
                templates["default"] = data["chat_template"]
        extra = directory / "additional_chat_templates"
        if extra.is_dir():
            for path in sorted(extra.glob("*.jinja")):
                templates[path.stem] = path.read_text(encoding="utf-8")
        jinja_file = directory / "chat_template.jinja"
        if jinja_file.is_file():
            templates["default"] = jinja_file.read_text(encoding="utf-8")
    return templates


def _mentions_type(node: Any, type_name: str) -> bool:
    if isinstance(node, Mapping):
        return node.get("type") == type_name or any(_mentions_type(v, type_name) for v in node.values())
    if isinstance(node, list):
        return any(_mentions_type(v, type_name) for v in node)
    return False


_BYTE_DECODER: dict[str, int] = {}


def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable-unicode stand-ins for raw bytes, reversed."""
    if not _BYTE_DECODER:
        printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                     *range(ord("®"), ord("ÿ") + 1)]
        chars = list(printable)
        extra = 0
        for b in range(256):
            if b not in printable:
                printable.append(b)
                chars.append(256 + extra)
                extra += 1
        _BYTE_DECODER.update({chr(c): b for b, c in zip(printable, chars, strict=True)})
    return _BYTE_DECODER
