"""Many requests per Tokenize call: concurrent tokenizations to one replica share gRPC calls.

A Python gRPC call costs ~0.6 ms of CPU on each side; a 2k-token prompt costs ~1 ms to encode. So
at high concurrency the router sends whatever tokenizations are waiting as batched Tokenize calls
(the API takes up to 64 inputs), with at most `max_calls` calls in flight per replica: while those
run, new requests queue and go together in the next call. An idle router sends a lone request at
once, so batching adds no latency when there is nothing to batch.

How many calls: what is waiting is spread over `spread` (2) calls, so the replica always has one
queued behind the one it encodes instead of idling while one big call's answers travel back; more
calls (up to `max_calls`) only when more is waiting than `spread` full calls carry, so that the
replica, which merges queued calls into one batch, encodes big batches at high concurrency (on
many cores a big batch leaves the library's threads less idle at its end). At most `max_bytes` of
input is in flight per replica (a lone input always goes), so long prompts from one router never
fill the replica's byte budget and get OVERLOADED.

Errors stay per request: the tokenizer fails a whole call when one input is invalid, so a
batched call that fails with INVALID_ARGUMENT is retried input by input, and only the bad
input's caller sees the error.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

import grpc

from services.errors import Reason, TokenrelayError
from services.mux import stream_error
from services.proto.tokenrelay.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from services.tracing import inject
from services.wire import unpack_ids

MAX_CALLS = 4            # calls in flight per replica
MAX_BYTES = 16 << 20     # input bytes in flight per replica (the replica's own budget is 32 MB)


@dataclass(slots=True)
class _Waiting:
    item: tokenizer_pb2.TokenizeInput
    future: asyncio.Future[list[int]]
    trace: dict[str, str]
    size: int   # serialized bytes


class TokenizeCoalescer:
    def __init__(self, stub: tokenizer_pb2_grpc.TokenizerStub, timeout: float, *, max_batch: int = 64,
                 max_calls: int = MAX_CALLS, spread: int = 2, max_bytes: int = MAX_BYTES) -> None:
        if min(max_batch, max_calls, spread, max_bytes) < 1:
            raise ValueError("max_batch, max_calls, spread and max_bytes must be >= 1")
        self._stub = stub
        self._timeout = timeout
        self._max_batch = max_batch
        self._max_calls = max_calls
        self._spread = min(spread, max_calls)
        self._max_bytes = max_bytes
        self._waiting: list[_Waiting] = []
        self._wake = asyncio.Event()
        self._call_ended = asyncio.Event()
        self._sender: asyncio.Task[None] | None = None
        # Calls in flight and their input bytes (this also keeps the tasks referenced: the loop
        # holds only weak references to tasks).
        self._in_flight: dict[asyncio.Task[None], int] = {}
        self.calls_sent = 0
        self.inputs_sent = 0

    async def tokenize(self, item: tokenizer_pb2.TokenizeInput, timeout: float) -> list[int]:
        if self._sender is None:
            self._sender = asyncio.create_task(self._send_forever(), name="tokenize-coalescer")
        future: asyncio.Future[list[int]] = asyncio.get_running_loop().create_future()
        # A batched call carries its first request's trace context (one call, one parent).
        self._waiting.append(_Waiting(item, future, inject(), item.ByteSize()))
        self._wake.set()
        return await asyncio.wait_for(future, timeout)

    @property
    def _bytes_in_flight(self) -> int:
        return sum(self._in_flight.values())

    async def _send_forever(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while True:
                self._waiting = [w for w in self._waiting if not w.future.done()]
                if not self._waiting:
                    break
                batch, nbytes = self._next_batch()
                if not batch:   # every call slot, or the byte budget, is taken: wait for a call to end
                    self._call_ended.clear()
                    await self._call_ended.wait()
                    continue
                task = asyncio.create_task(self._call(batch))
                self._in_flight[task] = nbytes
                task.add_done_callback(self._call_done)

    def _next_batch(self) -> tuple[list[_Waiting], int]:
        """The next call's requests (taken off the waiting list) and their bytes: a share of what
        is waiting (module doc) within the byte budget; none while every call slot is taken or
        the budget is spent."""
        in_flight = len(self._in_flight)
        if in_flight >= self._max_calls:
            return [], 0
        waiting = len(self._waiting)
        calls = max(min(-(-waiting // self._max_batch), self._max_calls - in_flight), self._spread - in_flight, 1)
        size = min(self._max_batch, -(-waiting // calls))
        budget = self._max_bytes - self._bytes_in_flight
        taken = nbytes = 0
        for w in self._waiting[:size]:
            if nbytes + w.size > budget and (taken or in_flight):
                break
            taken += 1
            nbytes += w.size
        batch = self._waiting[:taken]
        del self._waiting[:taken]
        return batch, nbytes

    def _call_done(self, task: asyncio.Task[None]) -> None:
        del self._in_flight[task]
        self._call_ended.set()

    async def _call(self, batch: list[_Waiting]) -> None:
        self.calls_sent += 1
        self.inputs_sent += len(batch)
        try:
            resp = await self._stub.Tokenize(
                tokenizer_pb2.TokenizeRequest(inputs=[w.item for w in batch], packed_ids=True), timeout=self._timeout,
                metadata=tuple(batch[0].trace.items()))
        except grpc.aio.AioRpcError as exc:
            if len(batch) > 1 and exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                await asyncio.gather(*(self._call([w]) for w in batch))  # isolate the bad input
                return
            _fail(batch, stream_error(exc, "tokenizer"))
            return
        except asyncio.CancelledError:  # the router is closing: nobody waits forever
            _fail(batch, Reason.SHUTTING_DOWN.error("router is shutting down"))
            raise
        except Exception as exc:  # noqa: BLE001 - every waiter must hear of it, none may hang
            _fail(batch, Reason.TOKENIZER_ERROR.error(f"tokenize call failed: {exc!r}"))
            return
        for waiting, result in zip(batch, resp.results, strict=True):
            if not waiting.future.done():
                waiting.future.set_result(unpack_ids(result.packed_ids))

    async def close(self) -> None:
        for task in [*self._in_flight, *([self._sender] if self._sender else [])]:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for waiting in self._waiting:
            if not waiting.future.done():
                waiting.future.cancel()


def _fail(batch: list[_Waiting], error: TokenrelayError) -> None:
    for waiting in batch:
        if not waiting.future.done():
            waiting.future.set_exception(error)
