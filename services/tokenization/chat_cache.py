"""Incremental chat tokenization: a new turn re-tokenizes only what changed.

Why it is exact: HF tokenizers split the input on added tokens (`<|im_start|>`, `<start_of_turn>`,
`<s>`, ...) before normalizing and pre-tokenizing, so the ids after an added token depend only on
the text from that token on. For a new rendering T' of a conversation whose previous rendering T
tokenized to ids I, let L be the length of the common prefix of T and T'. Take the last added
token of I that starts at char c with c + len(token) ≤ L; then

    tokenize(T') == I[:k] + tokenize(T'[c:])          (k = that token's index in I)

because T'[:c] == T[:c] and the token boundary at c is forced. `tokenize(T'[c:])` starts with the
added token itself at offset 0, so the text after it is tokenized as a non-first piece, exactly as
in the full string (this matters for SentencePiece's "prepend ▁ to the first piece" rules). If a
template rewrites earlier text (a changed system prompt, a header counting messages), L shrinks
and more is re-tokenized; with no usable boundary the whole text is tokenized. A check that the
suffix's first id is the expected added token guards the reasoning at run time.

Entries are keyed by an opaque cache key (the router passes tenant + session id, or for a chat
without one tenant + a hash of the conversation's opening: `router_svc.cache_key.tokenize_cache_key`),
held in an LRU bounded by a total token budget; ids are stored compactly in `array('I')`.
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from tokenizers import Encoding, Tokenizer


@dataclass(slots=True)
class _Entry:
    text: str
    ids: array  # type: ignore[type-arg]
    # (token index, char start) of every added token, in order
    anchors: list[tuple[int, int]]


@dataclass(frozen=True, slots=True)
class Plan:
    """How to tokenize one chat text: reuse `prefix` ids, then encode `suffix` (may be the whole text)."""

    key: str
    text: str
    prefix: array  # type: ignore[type-arg]
    cut: int                 # char offset where `suffix` starts in `text`
    anchor_id: int | None    # the added token the suffix must start with (None: no reuse)
    prefix_anchors: list[tuple[int, int]]

    @property
    def suffix(self) -> str:
        return self.text[self.cut:]


class ChatPrefixCache:
    def __init__(self, tokenizer: Tokenizer, max_tokens: int = 20_000_000) -> None:
        self._tokenizer = tokenizer
        self._added_ids = frozenset(tokenizer.get_added_tokens_decoder())
        self._max_tokens = max_tokens
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.reused_tokens = 0

    def plan(self, key: str, text: str) -> Plan:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
        if entry is None:
            return Plan(key, text, array("I"), 0, None, [])
        common = _common_prefix(entry.text, text)
        best: tuple[int, int] | None = None
        for index, start in reversed(entry.anchors):
            token_len = len(self._tokenizer.id_to_token(entry.ids[index]) or "")
            if start + token_len <= common:
                best = (index, start)
                break
        if best is None:
            return Plan(key, text, array("I"), 0, None, [])
        index, start = best
        kept = [a for a in entry.anchors if a[0] < index]
        return Plan(key, text, entry.ids[:index], start, entry.ids[index], kept)

    def complete(self, plan: Plan, encoding: Encoding) -> list[int] | None:
        """Join the plan's prefix with the suffix encoding and remember the result.

        Returns None when the suffix did not start with the expected added token (the caller
        then tokenizes the whole text and calls `remember`).
        """
        ids = encoding.ids
        if plan.anchor_id is not None and (not ids or ids[0] != plan.anchor_id):
            return None
        base = len(plan.prefix)
        added = [i for i, t in enumerate(ids) if t in self._added_ids]
        # `Encoding.offsets` builds the whole list on every access: read it once, and only if needed
        offsets = encoding.offsets if added else ()
        anchors = plan.prefix_anchors + [(base + i, plan.cut + offsets[i][0]) for i in added]
        full = plan.prefix + array("I", ids)
        with self._lock:
            if plan.anchor_id is not None:
                self.hits += 1
                self.reused_tokens += base
            else:
                self.misses += 1
        self._store(plan.key, _Entry(plan.text, full, anchors))
        return full.tolist()

    def _store(self, key: str, entry: _Entry) -> None:
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._tokens -= len(old.ids)
            self._entries[key] = entry
            self._tokens += len(entry.ids)
            while self._tokens > self._max_tokens and len(self._entries) > 1:
                _, dropped = self._entries.popitem(last=False)
                self._tokens -= len(dropped.ids)

    def __len__(self) -> int:
        return len(self._entries)


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # binary search on slice equality: C-speed compares, O(n log n) worst case
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
