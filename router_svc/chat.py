"""Bidirectional chat sessions: turns in, deltas out, cancel inside the stream.

A session keeps its conversation (messages so far) and sticks to one engine replica through its
session id, so earlier turns stay in that replica's prefix cache. Only one turn runs at a time;
a turn sent while one is running is rejected (FAILED_PRECONDITION would hide the cause, so the
reason is TURN_IN_PROGRESS with INVALID_ARGUMENT).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from services.errors import Reason

from .pipeline import Router, Sessions
from .tenants import Tenant
from .types import Accepted, Delta, Done, Event, GenerateInput, Sampling


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


@dataclass
class ChatCancel:
    pass


@dataclass
class ChatStarted:
    session_id: str


ChatIn = ChatStart | ChatTurn | ChatCancel
ChatOut = ChatStarted | Event

_END = object()


async def run_chat(router: Router, sessions: Sessions, tenant: Tenant,
                   incoming: AsyncIterator[ChatIn]) -> AsyncIterator[ChatOut]:
    first = await anext(incoming, None)
    if not isinstance(first, ChatStart):
        raise Reason.CHAT_NOT_STARTED.error("the first chat message must be `start`")
    session_id = sessions.claim(tenant, first.session_id)
    conversation: list[tuple[str, str]] = list(first.system)
    out: asyncio.Queue[object] = asyncio.Queue()
    turn_task: asyncio.Task[None] | None = None
    current_id: list[str] = []
    busy = False  # a turn is running; cleared before its last event is handed out

    async def run_turn(turn: ChatTurn) -> None:
        nonlocal busy
        text: list[str] = []
        inp = GenerateInput(sampling=turn.sampling, messages=conversation + turn.messages,
                            priority=first.priority, session_id=session_id,
                            return_token_ids=first.return_token_ids)
        try:
            async for event in router.generate(tenant, inp):
                if isinstance(event, Accepted):
                    current_id[:] = [event.request_id]
                elif isinstance(event, Delta):
                    text.append(event.text)
                elif isinstance(event, Done):
                    if event.finish_reason != "cancelled":
                        conversation.extend(turn.messages)
                        conversation.append(("assistant", "".join(text)))
                    busy = False
                await out.put(event)
        except Exception as exc:  # noqa: BLE001 - handed to the stream's consumer, re-raised there
            busy = False
            await out.put(exc)

    async def read() -> None:
        nonlocal turn_task, busy
        async for msg in incoming:
            if isinstance(msg, ChatTurn):
                if busy:
                    await out.put(Reason.TURN_IN_PROGRESS.error("a turn is already in progress"))
                    continue
                if not msg.messages:
                    await out.put(Reason.EMPTY_PROMPT.error("a turn needs at least one message"))
                    continue
                if turn_task is not None:
                    await asyncio.gather(turn_task, return_exceptions=True)
                busy = True
                current_id.clear()
                turn_task = asyncio.create_task(run_turn(msg))
            elif isinstance(msg, ChatCancel) and busy:
                if current_id:
                    router.cancel(tenant, current_id[0])
            elif isinstance(msg, ChatStart):
                await out.put(Reason.CHAT_ALREADY_STARTED.error("`start` may only be sent once"))
        if turn_task is not None:
            await asyncio.gather(turn_task, return_exceptions=True)
        await out.put(_END)

    reader = asyncio.create_task(read())
    try:
        yield ChatStarted(session_id)
        while True:
            item = await out.get()
            if item is _END:
                break
            if isinstance(item, Exception):
                raise item
            yield item  # type: ignore[misc]
    finally:
        reader.cancel()
        if turn_task is not None:
            turn_task.cancel()
        for task in (reader, turn_task):
            if task is not None:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        sessions.drop(session_id)
