"""`tokenrelay chat`: an interactive session. Ctrl-C stops the reply in progress and the session
goes on; Ctrl-C at the prompt, or end of input (Ctrl-D), quits.

Ctrl-C is a loop signal handler, not KeyboardInterrupt: under `asyncio.run` SIGINT cancels the main
task, which ended the whole session even mid-reply (issue 14). Standard input is read by a daemon
thread feeding a queue, so quitting never waits for a `readline` that is still blocked.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import threading
from typing import Any

from services.client import Client, Finished, TextDelta
from services.errors import TokenrelayError
from services.security import PLAINTEXT, SecuritySettings

BANNER = "type a message; Ctrl-C stops a reply, Ctrl-C at the prompt or Ctrl-D quits"


def _stdin_lines(loop: asyncio.AbstractEventLoop) -> asyncio.Queue[str]:
    """Lines of standard input as they come; "" at end of input."""
    queue: asyncio.Queue[str] = asyncio.Queue()

    def put(line: str) -> None:
        with contextlib.suppress(RuntimeError):   # the loop is gone: the session has ended
            loop.call_soon_threadsafe(queue.put_nowait, line)

    def pump() -> None:
        for line in iter(sys.stdin.readline, ""):
            put(line)
        put("")

    threading.Thread(target=pump, name="chat-stdin", daemon=True).start()
    return queue


class _Interrupts:
    """What Ctrl-C means now: stop the reply while one streams, else quit."""

    def __init__(self) -> None:
        self.quit = asyncio.Event()
        self.stop_reply: Any = None      # the turn's cancel while a reply streams
        self.stopping = False

    def __call__(self) -> None:
        if self.stop_reply is not None and not self.stopping:
            self.stopping = True
            self.stop_reply()
        else:                            # at the prompt, or a second Ctrl-C while a stop is pending
            self.quit.set()


async def _until(aw: Any, quit_event: asyncio.Event) -> Any:
    """`aw`'s result, or None when `quit_event` is set first."""
    task = asyncio.ensure_future(aw)
    quitting = asyncio.ensure_future(quit_event.wait())
    done, _ = await asyncio.wait({task, quitting}, return_when=asyncio.FIRST_COMPLETED)
    for t in (task, quitting):
        if t not in done:
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError, TokenrelayError):
                await t
    return task.result() if task in done else None


async def _reply(chat: Any, line: str, sampling: dict[str, Any], interrupts: _Interrupts) -> None:
    interrupts.stop_reply, interrupts.stopping = chat.cancel_turn, False
    try:
        async for event in chat.send(line, **sampling):
            if isinstance(event, TextDelta):
                sys.stdout.write(event.text)
                sys.stdout.flush()
            elif isinstance(event, Finished):
                sys.stdout.write(f"\\n[{event.finish_reason}, {event.completion_tokens} tokens]\\n")
                if interrupts.stopping:
                    sys.stdout.write("[reply stopped; Ctrl-C at the prompt or Ctrl-D quits]\\n")
    except TokenrelayError as exc:   # this turn failed (turn_error); the session goes on
        sys.stdout.write(f"\\n[turn failed: {exc.code.name} {exc.reason}: {exc.message}]\\n")
    finally:
        interrupts.stop_reply = None


async def run_chat(address: str, api_key: str, system: str | None, sampling: dict[str, Any], *,
                   security: SecuritySettings = PLAINTEXT) -> int:
    loop = asyncio.get_running_loop()
    interrupts = _Interrupts()
    loop.add_signal_handler(signal.SIGINT, interrupts)
    try:
        async with Client(address, api_key, security=security) as client, client.chat(system=system) as chat:
            print(f"[session {chat.session_id}] {BANNER}", file=sys.stderr)
            lines = _stdin_lines(loop)
            while True:
                sys.stdout.write("> ")
                sys.stdout.flush()
                line = await _until(lines.get(), interrupts.quit)
                if not line:             # Ctrl-C at the prompt (None) or end of input ("")
                    sys.stdout.write("\\n")
                    return 0
                if line.strip():
                    await _until(_reply(chat, line.rstrip("\\n"), sampling, interrupts), interrupts.quit)
                    if interrupts.quit.is_set():
                        sys.stdout.write("\\n")
                        return 0
    finally:
        loop.remove_signal_handler(signal.SIGINT)
