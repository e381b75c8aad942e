"""Encoder processes: the Python work per id on every core instead of under one interpreter lock.

In one process the tokenizers library encodes on every core, but reading each Encoding's ids into
Python and packing them runs under the process's one lock, beside the gRPC event loop. With
`--encode-processes N`, N child processes each hold a copy of the tokenizer (the parent's, as
JSON, so added tokens and settings are identical) and answer batches of texts with their ids
already packed (little-endian uint32 bytes, `services.wire`). A batch is cut into one chunk per
process (balanced by text length), the chunks encoded at once, the answers put back in order.

Each child encodes single-threaded (its library pool off), so N processes use N cores. A child
that dies fails the batches it held with `UNAVAILABLE/ENCODER_RESTARTED` and is replaced; the
pool never waits on a dead pipe.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection
import os
import queue
import threading
from dataclasses import dataclass
from typing import Any

from services.errors import Unavailable
from services.logging import get_logger
from tokenizer_svc.batcher import shutting_down

log = get_logger(__name__)


def _serve(conn: multiprocessing.connection.Connection, tokenizer_json: str) -> None:
    """A child: (texts, add_special_tokens) in, packed ids per text out, until None or EOF."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"   # one core per child
    from tokenizers import Tokenizer

    from services.wire import pack_ids

    tok = Tokenizer.from_str(tokenizer_json)
    tok.no_padding()
    tok.no_truncation()
    while True:
        try:
            ask = conn.recv()
        except EOFError:
            return
        if ask is None:
            return
        texts, special = ask
        try:
            conn.send([pack_ids(e.ids) for e in tok.encode_batch_fast(texts, add_special_tokens=special)])
        except Exception as exc:  # noqa: BLE001 - the parent raises it for the batch; the child lives on
            conn.send(exc)


@dataclass(eq=False)
class _Child:
    process: Any   # multiprocessing.Process of the spawn context
    conn: multiprocessing.connection.Connection


class EncodeProcessPool:
    def __init__(self, tokenizer_json: str, processes: int) -> None:
        if processes < 1:
            raise ValueError("processes must be >= 1")
        self._json = tokenizer_json
        self.processes = processes
        # spawn, not fork: the parent runs gRPC and worker threads, which a fork would copy mid-state.
        self._ctx = mp.get_context("spawn")
        self._idle: queue.SimpleQueue[_Child | None] = queue.SimpleQueue()   # None: closing
        self._children: list[_Child] = []
        self._lock = threading.Lock()
        self._closed = False

    def start(self) -> None:
        for _ in range(self.processes):
            self._idle.put(self._spawn())

    def _spawn(self) -> _Child:
        parent, child = self._ctx.Pipe()
        process = self._ctx.Process(target=_serve, args=(child, self._json), daemon=True, name="tokenize-encoder")
        process.start()
        child.close()
        entry = _Child(process, parent)
        with self._lock:
            self._children.append(entry)
        return entry

    def encode(self, texts: list[str], add_special_tokens: bool) -> list[bytes]:
        """Packed ids per text, in order. Blocking: call it from a worker thread.

        The texts go out in chunks to whichever child is idle, and a child that answers gets the
        next chunk, so one long text does not hold the others back; a batch holds only children
        that are working on its chunks, so concurrent batches share the children without deadlock."""
        if self._closed:
            raise shutting_down()
        out: list[bytes] = [b""] * len(texts)
        todo = _chunks(texts, self.processes)
        busy: dict[Any, tuple[_Child, int, int]] = {}
        failed: BaseException | None = None
        while todo or busy:
            while todo:
                try:   # wait for a child only while this batch holds none (else: wait for answers)
                    child = self._idle.get_nowait() if busy else self._idle.get()
                except queue.Empty:
                    break
                if child is None:   # closing: wake the next waiter too
                    self._idle.put(None)
                    raise shutting_down()
                start, end = todo.pop()
                try:
                    child.conn.send((texts[start:end], add_special_tokens))
                except (OSError, EOFError) as exc:
                    failed = failed or exc
                    self._replace(child)
                    continue
                busy[child.conn] = (child, start, end)
            if not busy:
                continue
            for conn in mp.connection.wait(list(busy)):
                child, start, end = busy.pop(conn)
                try:
                    answer = child.conn.recv()
                except (OSError, EOFError) as exc:
                    failed = failed or exc
                    self._replace(child)
                    continue
                self._idle.put(child)
                if isinstance(answer, BaseException):
                    failed = failed or answer
                else:
                    out[start:end] = answer
        if failed is not None:
            if isinstance(failed, (OSError, EOFError)):
                raise Unavailable("a tokenizer encoder process died; it has been replaced",
                                  "ENCODER_RESTARTED", retry_after=0.1)
            raise failed
        return out

    def _replace(self, child: _Child) -> None:
        log.error("encoder_process_died", pid=child.process.pid, exitcode=child.process.exitcode)
        with self._lock:
            if child in self._children:
                self._children.remove(child)
        child.conn.close()
        if child.process.is_alive():
            child.process.kill()
        child.process.join(5)
        if not self._closed:
            self._idle.put(self._spawn())

    def pids(self) -> list[int]:
        with self._lock:
            return [c.process.pid for c in self._children]

    def close(self) -> None:
        self._closed = True
        self._idle.put(None)   # a batch waiting for a child gives up instead of waiting forever
        with self._lock:
            children, self._children = self._children, []
        for child in children:
            try:
                child.conn.send(None)
            except (OSError, EOFError):
                pass
        for child in children:
            child.process.join(5)
            if child.process.is_alive():
                child.process.kill()
                child.process.join(5)
            child.conn.close()


def _chunks(texts: list[str], processes: int) -> list[tuple[int, int]]:
    """Contiguous (start, end) ranges of about twice as many as there are processes (balanced by
    text length, each at least ~8 kB of text so a chunk is worth its round trip), last first."""
    total = sum(len(t) for t in texts)
    target = max(total / (2 * processes), 8192)
    ranges, start, size = [], 0, 0
    for i, text in enumerate(texts):
        size += len(text)
        if size >= target:
            ranges.append((start, i + 1))
            start, size = i + 1, 0
    if start < len(texts):
        ranges.append((start, len(texts)))
    return ranges[::-1]   # popped from the end: the first range goes first
