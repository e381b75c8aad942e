"""Exact incremental detokenization of one token stream, with bounded work per token.

The text of a stream is defined as `decode(P + G)[len(decode(P)):]` for prompt ids P and
generated ids G (just `decode(G)` without a prompt). Decoding each new token on its own is
wrong twice over (TGI/SGLang/vLLM learned it, Triton's post-processing did not): a
SentencePiece piece loses its leading space when decoded alone, and a multi-byte character can
be split over several byte tokens. So, like TGI's and vLLM's `prefix_offset`/`read_offset`:

* the decoder keeps a short window of ids: the chunk emitted last (context) plus the ids not yet
  emitted; each step decodes the window and emits what extends past the context's text;
* text ending in U+FFFD may be an incomplete character: the raw bytes of the trailing tokens say
  whether it is; if so, its tokens stay unread until a later token completes it, while the text
  before it is emitted at once. A genuine U+FFFD (or invalid bytes) is emitted right away;
* skipped special tokens are dropped before they enter the window (decode filters them anyway),
  so they cannot wipe out the context that keeps a leading space.

Exactness holds for valid UTF-8. Invalid bytes (a special token in the middle of a character's
byte pieces, or a stream that ends mid-character) come out as U+FFFD; but byte fallback's full
decode then turns the *whole* run of byte pieces into U+FFFD, complete characters included,
which text already streamed cannot follow: the stream keeps those characters.

Only a bounded tail of P is used: enough tokens to start on a character boundary and to decode
to some text. If P ends inside a character (a stream resumed mid-character, e.g. after token
migration), the stream continues right after what a client streaming P had received, so that
received + continuation == decode(P + G): nothing lost, nothing repeated.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

REPLACEMENT = "\ufffd"
CONTEXT_TOKENS = 6        # prompt tokens kept for context, before boundary adjustments
MAX_CONTEXT_TOKENS = 32   # never look further back than this into the prompt
MAX_UNREAD = 8            # a "character" still incomplete after this many tokens is invalid bytes

Decode = Callable[[list[int], bool], str]
TokenBytes = Callable[[int], bytes]


class IncrementalDecoder:
    """Turns token ids, one at a time, into text deltas whose concatenation is the full decode."""

    __slots__ = ("_bytes", "_decode", "_ids", "_partial", "_prefix_text", "_read", "_skip", "_special")

    def __init__(self, decode: Decode, *, skip_special_tokens: bool, special_ids: Collection[int] = (),
                 prefix_ids: Sequence[int] = (), token_bytes: TokenBytes | None = None) -> None:
        self._decode = decode
        self._skip = skip_special_tokens
        self._special = special_ids if skip_special_tokens else ()
        self._bytes = token_bytes
        tail = self._kept(prefix_ids[-MAX_CONTEXT_TOKENS:]) if prefix_ids else []
        # _ids[:_read] is context already emitted (its text: _prefix_text); _ids[_read:] is unread,
        # of which the first _partial characters past the context were emitted early.
        self._ids, self._read = _context(tail, decode, skip_special_tokens, token_bytes)
        self._prefix_text = decode(self._ids[:self._read], skip_special_tokens) if self._read else ""
        self._partial = 0
        if self._read < len(self._ids):
            stable = decode(self._ids, skip_special_tokens).rstrip(REPLACEMENT)
            self._partial = max(0, len(stable) - len(self._prefix_text))

    def _kept(self, ids: Sequence[int]) -> list[int]:
        special = self._special
        return [i for i in ids if i not in special] if special else list(ids)

    def step(self, token_id: int) -> str:
        """Add one id; return the text it makes final (often "", e.g. mid-character)."""
        if token_id in self._special:
            return ""
        ids = self._ids
        ids.append(token_id)
        text = self._decode(ids, self._skip)
        done = len(self._prefix_text) + self._partial
        if len(text) <= done:
            if len(ids) - self._read >= 4 * MAX_UNREAD:
                # Ids that never add text (e.g. empty pieces) must not grow the window forever.
                del ids[self._read:-1]
            return ""
        if text.endswith(REPLACEMENT) and self._unfinished(ids):
            # Emit what precedes the unfinished character now; keep its ids unread.
            stable = text.rstrip(REPLACEMENT)
            if len(stable) <= done:
                return ""
            self._partial = len(stable) - len(self._prefix_text)
            return stable[done:]
        # What was unread becomes the context of the next step; older ids are dropped.
        del ids[:self._read]
        self._read = len(ids)
        self._prefix_text = self._decode(ids, self._skip)
        self._partial = 0
        return text[done:]

    def _unfinished(self, ids: list[int]) -> bool:
        """Is the trailing U+FFFD an incomplete character (rather than a real U+FFFD or bad bytes)?"""
        if len(ids) - self._read >= MAX_UNREAD:
            return False
        return self._bytes is None or _incomplete_tail_tokens(ids, self._bytes) > 0

    def extend(self, token_ids: Sequence[int]) -> str:
        return "".join([self.step(t) for t in token_ids])

    def flush(self) -> str:
        """Everything still held back, an incomplete character included (as U+FFFD)."""
        if len(self._ids) == self._read:
            return ""
        text = self._decode(self._ids, self._skip)
        delta = text[len(self._prefix_text) + self._partial:]
        del self._ids[:self._read]
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._ids, self._skip)
        self._partial = 0
        return delta


def _context(tail: list[int], decode: Decode, skip: bool, token_bytes: TokenBytes | None) -> tuple[list[int], int]:
    """(window, read offset) for a prompt tail: a window that starts on a character boundary and
    decodes to some text, with the ids of an unfinished last character left unread."""
    if not tail:
        return [], 0
    read_end = len(tail) - _incomplete_tail_tokens(tail, token_bytes)
    start = max(0, read_end - CONTEXT_TOKENS)
    while start > 0 and not _clean_start(tail, start, read_end, decode, skip, token_bytes):
        start -= 1
    return tail[start:], read_end - start


def _clean_start(ids: list[int], start: int, end: int, decode: Decode, skip: bool,
                 token_bytes: TokenBytes | None) -> bool:
    # Starting on a UTF-8 continuation byte would garble the first character (and, with byte
    # fallback, the whole run of byte pieces); empty context would let a SentencePiece decoder
    # strip the next piece's leading space.
    if token_bytes is not None:
        first = token_bytes(ids[start])
        if first and 0x80 <= first[0] < 0xC0:
            return False
    text = decode(ids[start:end], skip)
    return bool(text) and not text.startswith(REPLACEMENT)


def _incomplete_tail_tokens(ids: list[int], token_bytes: TokenBytes | None) -> int:
    """How many trailing ids carry the bytes of a UTF-8 character that is not finished yet."""
    if token_bytes is None:
        return 0
    data = b""
    for count in range(1, min(4, len(ids)) + 1):
        data = token_bytes(ids[-count]) + data
        if not data:
            continue
        # Look at the last (up to 4) bytes for a lead byte whose sequence runs past the end.
        for back in range(1, min(4, len(data)) + 1):
            byte = data[-back]
            if byte < 0x80:
                return 0
            if byte >= 0xC0:
                need = 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
                if need <= back:
                    return 0
                # The incomplete character starts `back` bytes before the end: count the tokens
                # whose bytes lie in that range.
                return _tokens_covering(ids, back, token_bytes)
        if len(data) >= 4:
            return 0
    return 0


def _tokens_covering(ids: list[int], nbytes: int, token_bytes: TokenBytes) -> int:
    covered = 0
    for count in range(1, len(ids) + 1):
        covered += len(token_bytes(ids[-count]))
        if covered >= nbytes:
            return count
    return len(ids)
