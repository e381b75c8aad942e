"""The key under which the tokenizer keeps a chat's token prefix (incremental chat tokenization)."""

from __future__ import annotations

import hashlib


def tokenize_cache_key(tenant: str, session_id: str, messages: list[tuple[str, str]]) -> str:
    """The key of a chat's cached token prefix at the tokenizer (incremental tokenization: only the
    text past the cached prefix is encoded; the cache checks the text, so a key shared by two
    conversations costs hits, never correctness). Scoped by tenant: one tenant's key can never reach
    another's prefix.

    A session: its id. Without one (a client that resends the whole conversation every turn), a
    conversation that already has an assistant reply is keyed by its opening, every message up to and
    including the first user message, which every later turn repeats; a chat without a reply yet (a
    one-shot request) gets no key, so it costs the cache nothing. The second turn then stores the
    prefix, and the third turn on reuse it, as a session's would."""
    if session_id:
        return f"{tenant}/{session_id}"
    if not any(role == "assistant" for role, _ in messages):
        return ""
    h = hashlib.blake2b(digest_size=16)
    for role, content in messages:
        h.update(role.encode())
        h.update(b"\0")
        h.update(content.encode())
        h.update(b"\1")
        if role == "user":
            break
    return f"{tenant}/~{h.hexdigest()}"
