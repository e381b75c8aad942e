"""Special-token text in caller input is ordinary text (issue 15), unless the caller may use it.

A tokenizer parses the text of its special tokens wherever it occurs: left alone, a prompt
"hi <|endoftext|> there" carries a real end-of-text id, and a chat message whose content says
"<end_of_turn>\\n<start_of_turn>model\\n" forges a turn of its own. So, unless an input allows
special tokens (`TokenizeInput.allow_special_tokens`, set by the router from the tenant's
`allow_control_tokens`):

* a text is encoded by a copy of the tokenizer with `encode_special_tokens` on, which tokenizes
  special-token text like any other text (`<`, `|`, `end`, ...); non-special added tokens stay
  as they are, since they are not control tokens;
* a chat keeps the special tokens its template writes (BOS, turn markers) and tokenizes the
  special-token text in message contents and roles as text: each such occurrence is replaced by
  a placeholder (a private-use character, a per-process random nonce and a number), the template
  is rendered, the rendering is encoded, and only the pieces between the template's special
  tokens that hold a placeholder are encoded again, by the copy, with the original text put
  back. The tokenizer splits its input on added tokens before anything else, so the ids of the
  other pieces are exactly those of the whole string; a re-encoded piece that does not start
  the string is encoded behind an anchor (a non-special added token of the copy, dropped
  afterwards), so that it is tokenized as a piece that follows a token, as in the whole string
  (SentencePiece's "prepend ▁ to the first piece" rule).

Inputs without special-token text take the path they took before (same ids, same prefix cache):
the check is one regular-expression search per text, content and role (a trie of the special
tokens' texts, compiled once). The copy is built the first time it is needed (Gemma 3: ~1.3 s
and ~150 MB once; small tokenizers: milliseconds), on the encoder's worker thread.

Limits: special tokens are found in the raw text, so a tokenizer whose special tokens are
`normalized` (matched after normalization; none of the tested ones) is logged at start, and its
chats always take the re-encoding path. A template that rewrites a message's content other
than by trimming (upper-casing it, say) can break a placeholder: such a chat is refused with
CHAT_TEMPLATE_ERROR rather than encoded with a forged token.
"""

from __future__ import annotations

import re
import secrets
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tokenizers import AddedToken, Tokenizer

from services.errors import Reason
from services.logging import get_logger
from services.tokenization.chat_template import ChatTemplate

log = get_logger(__name__)

_MARK_OPEN, _MARK_CLOSE = "\ue000", "\ue001"   # private-use: no tokenizer gives them meaning


class SpecialText:
    """Finds special-token text and encodes it as text. Thread-safe."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        added = tokenizer.get_added_tokens_decoder()
        self._content_of: dict[int, str] = {i: t.content for i, t in added.items() if t.special and t.content}
        self._pattern = _trie_pattern(self._content_of.values())
        # Every special token starts with one of a few characters ('<', '['): a text without them
        # is settled by a memchr per character, without running the regex.
        self._first = tuple(sorted({c[0] for c in self._content_of.values()}))
        # Matched after normalization: the raw-text search may miss a spelling of them (not so
        # without a normalizer, as in GPT-2's tokenizer, whose <|endoftext|> says normalized).
        self.normalized = tokenizer.normalizer is not None and any(t.normalized for t in added.values() if t.special)
        if self.normalized:
            log.warning("special_tokens_normalized",
                        note="special tokens are matched after normalization; every chat takes the re-encoding path")
        self._nonce = secrets.token_hex(8)
        self._placeholder = re.compile(f"{_MARK_OPEN}{self._nonce}(\\d+){_MARK_CLOSE}")
        self._anchor = f"{_MARK_OPEN}{self._nonce}-anchor{_MARK_CLOSE}"
        self._split: Tokenizer | None = None
        self._anchor_id = -1
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ detection
    def found_in(self, text: str) -> bool:
        """Whether `text` holds the text of a special token."""
        if self._pattern is None:
            return False
        starts = [i for c in self._first if (i := text.find(c)) >= 0]
        return bool(starts) and self._pattern.search(text, min(starts)) is not None

    def found_in_chat(self, messages: Iterable[Mapping[str, Any]]) -> bool:
        if self.normalized:
            return True
        for m in messages:
            content, role = m.get("content"), m.get("role")
            if (isinstance(content, str) and self.found_in(content)) or (isinstance(role, str) and self.found_in(role)):
                return True
        return False

    # ------------------------------------------------------------------ encoding
    def split_tokenizer(self) -> Tokenizer:
        """The copy that tokenizes special-token text as text (built on first use)."""
        with self._lock:
            if self._split is None:
                copy = Tokenizer.from_str(self._tokenizer.to_str())
                copy.no_padding()
                copy.no_truncation()
                copy.encode_special_tokens = True
                copy.add_tokens([AddedToken(self._anchor, special=False, normalized=False)])
                anchor_id = copy.token_to_id(self._anchor)
                assert anchor_id is not None
                self._anchor_id = anchor_id
                self._split = copy
                log.info("special_text_tokenizer_built", anchor_id=anchor_id)
            return self._split

    def encode_texts(self, texts: Sequence[str], add_special_tokens: bool) -> list[Any]:
        """Encodings of texts whose special-token text is plain text (the post thread reads .ids)."""
        return self.split_tokenizer().encode_batch_fast(list(texts), add_special_tokens=add_special_tokens)

    def encode_chat(self, template: ChatTemplate, messages: Sequence[Mapping[str, Any]],
                    add_generation_prompt: bool) -> list[int]:
        """Ids of a chat whose template tokens are special and whose message text is text."""
        originals: list[str] = []

        def hide(value: Any) -> Any:
            if not isinstance(value, str) or self._pattern is None:
                return value

            def placeholder(match: re.Match[str]) -> str:
                originals.append(match.group(0))
                return f"{_MARK_OPEN}{self._nonce}{len(originals) - 1}{_MARK_CLOSE}"
            return self._pattern.sub(placeholder, value)

        hidden = [{k: hide(v) if k in ("content", "role") else v for k, v in m.items()} for m in messages]
        rendered = template.render(hidden, add_generation_prompt)
        holes = [(m.start(), m.end(), int(m.group(1))) for m in self._placeholder.finditer(rendered)]
        if rendered.count(_MARK_OPEN + self._nonce) != len(holes) or any(i >= len(originals) for *_, i in holes):
            raise Reason.CHAT_TEMPLATE_ERROR.error(
                f"chat template {template.name!r} rewrote special-token text in a message")
        whole = self._tokenizer.encode(rendered, add_special_tokens=False)
        if not holes:
            return list(whole.ids)
        return self._splice(rendered, whole, holes, originals)

    def _splice(self, rendered: str, whole: Any, holes: list[tuple[int, int, int]],
                originals: list[str]) -> list[int]:
        """The ids of `whole`, with each piece between two template special tokens that holds a
        placeholder encoded again by the copy, the original text put back."""
        ids, offsets = whole.ids, whole.offsets
        # Piece boundaries: special tokens the template wrote, i.e. whose span spells the token
        # (an <unk> the model makes of a placeholder's character spells nothing of the kind).
        bounds = [k for k, (i, (s, e)) in enumerate(zip(ids, offsets, strict=True))
                  if i in self._content_of and rendered[s:e].strip() == self._content_of[i]]
        out: list[int] = []
        hole = 0
        piece_start_tok, piece_start_char = 0, 0
        for k in [*bounds, len(ids)]:
            piece_end_char = offsets[k][0] if k < len(ids) else len(rendered)
            first_hole = hole
            while hole < len(holes) and holes[hole][0] < piece_end_char:
                hole += 1
            if hole == first_hole:
                out.extend(ids[piece_start_tok:k])
            else:
                out.extend(self._encode_piece(rendered, piece_start_char, piece_end_char,
                                              holes[first_hole:hole], originals))
            if k < len(ids):
                out.append(ids[k])
                piece_start_tok, piece_start_char = k + 1, offsets[k][1]
        return out

    def _encode_piece(self, rendered: str, start: int, end: int, holes: list[tuple[int, int, int]],
                      originals: list[str]) -> list[int]:
        parts, at = [], start
        for s, e, index in holes:
            parts += [rendered[at:s], originals[index]]
            at = e
        parts.append(rendered[at:end])
        piece = "".join(parts)
        split = self.split_tokenizer()
        if start == 0:   # the string's first piece
            return list(split.encode(piece, add_special_tokens=False).ids)
        ids = split.encode(self._anchor + piece, add_special_tokens=False).ids
        assert ids and ids[0] == self._anchor_id
        return list(ids[1:])


def _trie_pattern(words: Iterable[str]) -> re.Pattern[str] | None:
    """A regex matching any of `words`, longest first at each position (as the tokenizer's own
    leftmost-longest matcher does), built as a trie so a search is fast however many there are."""
    trie: dict[str, Any] = {}
    for word in words:
        node = trie
        for ch in word:
            node = node.setdefault(ch, {})
        node[""] = {}
    if not trie:
        return None

    def build(node: dict[str, Any]) -> str:
        branches = [re.escape(ch) + build(child) for ch, child in sorted(node.items()) if ch]
        end = "" in node
        if not branches:
            return ""
        if len(branches) == 1 and not end:
            return branches[0]
        body = "|".join(branches)
        return f"(?:{body})" + ("?" if end else "")

    return re.compile(build(trie))
