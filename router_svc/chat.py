"""Bidirectional chat sessions: turns in, deltas out, cancel inside the stream.

A session keeps its conversation (messages so far) and sticks to one engine replica through its
(tenant, session id), so earlier turns stay in that replica's prefix cache. Only one turn runs at
a time. Any error of one turn (a turn sent while one runs, an empty turn, a validation error, a
failure of its generation) fails THAT turn only, as a `TurnError` event; the session and the turn
in progress go on. What ends the whole stream: a first message that is not `start`, a bad
session id, or a message that does not decode (INVALID_ARGUMENT, MALFORMED_MESSAGE).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from services.errors import Reason, TokenrelayError
from services.logging import get_logger

from .pipeline import Router
from .tenants import Tenant
from .types import Delta, Done, Event, GenerateInput, Sampling, TurnError
from .validation import DEFAULT_BOUNDS, Bounds

log = get_logger(__name__)


@dataclass
class ChatStart:
    session_id: str = ""
    system: list[tuple[str, str]] = field(default_factory=list)
    priority: int = 0
    return_token_ids: bool = False


@dataclass
class ChatTurn:
    messages: list[tuple[str, str]]
    sampling: Sampling
    min_delta_tokens: int = 0
    min_delta_interval_ms: int = 0


@dataclass
class ChatCancel:
    pass


@dataclass
class ChatStarted:
    session_id: str


ChatIn = ChatStart | ChatTurn | ChatCancel
ChatOut = ChatStarted | Event | TurnError

_END = object()


class Sessions:
    """Chat session ids: given (bounded) or generated. Every use of a session id is scoped by
    its tenant (tokenizer cache key, engine affinity), so tenants never share or see sessions."""

    def __init__(self, bounds: Bounds = DEFAULT_BOUNDS) -> None:
        self.bounds = bounds

    def claim(self, tenant: Tenant, session_id: str) -> str:
        if len(session_id) > self.bounds.max_session_id:
            raise Reason.INVALID_SESSION_ID.error(f"session_id longer than {self.bounds.max_session_id}")
        return session_id or uuid.uuid4().hex

    def drop(self, session_id: str) -> None:
        return None


def turn_error(exc: Exception, request_id: str = "") -> TurnError:
    if not isinstance(exc, TokenrelayError):
        log.error("chat_turn_crashed", error=repr(exc))
        exc = Reason.INTERNAL.error("the turn failed unexpectedly")
    return TurnError(exc.reason, exc.code.name, exc.message, exc.retry_after, request_id)


class _Session:
    def __init__(self, router: Router, tenant: Tenant, start: ChatStart, session_id: str) -> None:
        self.router, self.tenant, self.start, self.session_id = router, tenant, start, session_id
        self.conversation: list[tuple[str, str]] = list(start.system)
        self.out: asyncio.Queue[object] = asyncio.Queue()
        self.turn_task: asyncio.Task[None] | None = None
        self.current_id = ""
        self.busy = False   # a turn is running; cleared before its last event is handed out

    async def run_turn(self, turn: ChatTurn) -> None:
        text: list[str] = []
        inp = GenerateInput(sampling=turn.sampling, messages=self.conversation + turn.messages,
                            priority=self.start.priority, session_id=self.session_id,
                            return_token_ids=self.start.return_token_ids, request_id=uuid.uuid4().hex,
                            min_delta_tokens=turn.min_delta_tokens,
                            min_delta_interval_ms=turn.min_delta_interval_ms)
        self.current_id = inp.request_id
        try:
            async for event in self.router.generate(self.tenant, inp):
                if isinstance(event, Delta):
                    text.append(event.text)
                elif isinstance(event, Done):
                    if event.finish_reason != "cancelled":
                        self.conversation.extend(turn.messages)
                        self.conversation.append(("assistant", "".join(text)))
                    self.busy = False
                self.out.put_nowait(event)
        except Exception as exc:  # noqa: BLE001 - this turn fails; the session goes on
            self.busy = False
            self.out.put_nowait(turn_error(exc, inp.request_id))

    async def on_message(self, msg: ChatIn) -> None:
        if isinstance(msg, ChatTurn):
            if self.busy:
                self.out.put_nowait(turn_error(Reason.TURN_IN_PROGRESS.error("a turn is already in progress")))
                return
            if not msg.messages:
                self.out.put_nowait(turn_error(Reason.EMPTY_PROMPT.error("a turn needs at least one message")))
                return
            if self.turn_task is not None:
                await asyncio.gather(self.turn_task, return_exceptions=True)
            self.busy = True
            self.turn_task = asyncio.create_task(self.run_turn(msg))
        elif isinstance(msg, ChatCancel):
            if self.busy and self.current_id:
                await self.router.cancel(self.tenant, self.current_id)
        elif isinstance(msg, ChatStart):
            self.out.put_nowait(turn_error(Reason.CHAT_ALREADY_STARTED.error("`start` may only be sent once")))

    async def read(self, incoming: AsyncIterator[ChatIn]) -> None:
        try:
            async for msg in incoming:
                await self.on_message(msg)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - e.g. an undecodable message: ends the stream
            self.out.put_nowait(exc)
            return
        if self.turn_task is not None:
            await asyncio.gather(self.turn_task, return_exceptions=True)
        self.out.put_nowait(_END)

    async def close(self, reader: asyncio.Task[None]) -> None:
        reader.cancel()
        if self.turn_task is not None:
            self.turn_task.cancel()
        for task in (reader, self.turn_task):
            if task is not None:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task


async def run_chat(router: Router, sessions: Sessions, tenant: Tenant,
                   incoming: AsyncIterator[ChatIn]) -> AsyncIterator[ChatOut]:
    first = await anext(incoming, None)
    if not isinstance(first, ChatStart):
        raise Reason.CHAT_NOT_STARTED.error("the first chat message must be `start`")
    session = _Session(router, tenant, first, sessions.claim(tenant, first.session_id))
    reader = asyncio.create_task(session.read(incoming))
    try:
        yield ChatStarted(session.session_id)
        while True:
            item = await session.out.get()
            if item is _END:
                break
            if isinstance(item, Exception):
                raise item
            yield item  # type: ignore[misc]
    finally:
        await session.close(reader)
        sessions.drop(session.session_id)

