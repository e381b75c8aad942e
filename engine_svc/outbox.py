"""The per-stream outbox: coalesces every token ready since the last send into one batch of chunks.

Producers (backend sinks) call `push()` — an O(1) append to the request's pending buffer plus an
`asyncio.Event.set()`; the stream's single writer awaits `wait()` and takes everything with
`drain()`. A message therefore never waits for more tokens (the first chunk of a request goes out
on the writer's next turn, which is what TTFT needs), yet under load one message carries the
tokens of many requests and many steps (Python gRPC costs ~100 µs of CPU per message).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from .backends.base import FinishReason, GenerationEvent


@dataclass(slots=True)
class Chunk:
    """New tokens of one request since its previous chunk (mirrors the proto's TokenChunk)."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: FinishReason | None = None
    cached_tokens: int = 0
    error_reason: str = ""
    error_message: str = ""


class Outbox:
    def __init__(self) -> None:
        self._pending: dict[str, Chunk] = {}
        self._separate: list[Chunk] = []
        self._ready = asyncio.Event()
        self.messages = 0
        self.chunks = 0

    def push(self, event: GenerationEvent) -> None:
        chunk = self._pending.get(event.request_id)
        if chunk is None:
            chunk = self._pending[event.request_id] = Chunk(event.request_id)
        chunk.token_ids += event.token_ids
        if event.cached_tokens:
            chunk.cached_tokens = event.cached_tokens
        if event.finished:
            chunk.finished = True
            chunk.finish_reason = event.finish_reason
            chunk.error_reason = event.error_reason
            chunk.error_message = event.error_message
        self._ready.set()

    def push_separate(self, event: GenerationEvent) -> None:
        """A chunk that must not merge with the pending chunk of the same id (a rejected duplicate)."""
        self._separate.append(Chunk(event.request_id, list(event.token_ids), event.finished,
                                    event.finish_reason, event.cached_tokens, event.error_reason,
                                    event.error_message))
        self._ready.set()

    def wake(self) -> None:
        """Wake the writer without data (e.g. to let it notice the stream ended)."""
        self._ready.set()

    async def wait(self) -> None:
        await self._ready.wait()
        self._ready.clear()

    def drain(self) -> list[Chunk]:
        if not self._pending and not self._separate:
            return []
        chunks = list(self._pending.values())
        self._pending = {}
        if self._separate:
            chunks += self._separate
            self._separate = []
        self.messages += 1
        self.chunks += len(chunks)
        return chunks

    @property
    def empty(self) -> bool:
        return not self._pending and not self._separate
