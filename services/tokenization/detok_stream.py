"""One multiplexed Detokenize stream: per-request decoder + stop-string state, fed in batches.

A stream carries many requests. Each inbound batch is applied in order: opens, then tokens,
then closes; the result is one list of outputs (at most one per request id, deltas merged),
empty deltas left out unless they finish a request or report an error. A problem with one
request becomes an `error` on its output and never ends the stream.

Error codes in `Output.error` (`services.errors.Reason`): UNKNOWN_REQUEST (tokens for an id that
is not open), DUPLICATE_REQUEST_ID (open for an id already open; the first one carries on),
OVERLOADED (the stream's open-request limit; the router's client gets UNAVAILABLE and a
retry-after), INVALID_TOKEN_ID (an id outside the vocabulary), INVALID_STOP (more than MAX_STOPS
stop strings, or one longer than MAX_STOP_CHARS), INTERNAL (a bug; logged).

Bounded work per message (issue 15): a message with more opens than `max_message_opens` or more
token ids than `max_message_tokens` ends the stream with INVALID_ARGUMENT/BATCH_TOO_LARGE (such a
message is a client's bug: the router sends what its requests posted since its last message).
Below those bounds, a message whose work is over `inline_tokens` runs on a worker thread, in
slices of at most `slice_tokens` units (a token is one unit, an open OPEN_COST, a close one;
one request's long run of ids is cut too), the loop resubmitting the next slice: one message
never holds the event loop, converting the protobuf message included (`Converted`), and a
stream's big message never holds the worker for long while other streams' messages wait behind
it. The outputs are those of applying the message at once (one per request, deltas merged).
Per stream there is no bound on ids over time: each request keeps a bounded window of ids.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, overload

from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from services.errors import Reason
from services.logging import get_logger
from services.tokenization import metrics
from services.tokenization.detokenizer import MAX_CONTEXT_TOKENS, IncrementalDecoder
from services.tokenization.loader import LoadedTokenizer
from services.tokenization.stop_strings import StopMatcher
from services.tracing import recorded_parent, start_span, tracer

log = get_logger(__name__)
_T = TypeVar("_T")
_tracer = tracer("tokenrelay.tokenizer")

# Ids of recently finished requests, so trailing tokens sent before the engine saw the stop are
# ignored rather than reported as unknown.
FINISHED_MEMORY = 4096
# Stop matching costs O(total stop length) per token; bound what one request may ask for.
MAX_STOPS = 64
MAX_STOP_CHARS = 1024
# Batches this small cost less than a hop to a worker thread (~50 µs), so they run inline.
INLINE_TOKENS = 16
# Work units of one slice of a big message (~2.5 ms of a core: a token's step is ~2.3 µs), and an
# open in those units (it makes a decoder, a stop matcher and a span: ~15 µs, more with tracing).
SLICE_TOKENS = 1024
OPEN_COST = 10
MAX_MESSAGE_OPENS = 10_000
CLOSE_INLINE = 256      # requests still open that a stream's end abandons on the loop itself
MAX_MESSAGE_TOKENS = 1 << 18


class Converted(Sequence[_T]):
    """A read-only sequence that converts each item of `raw` (a protobuf repeated field) when it
    is read, so that a message's conversion happens slice by slice where the slice runs."""

    __slots__ = ("_convert", "_raw")

    def __init__(self, raw: Sequence[Any], convert: Callable[[Any], _T]) -> None:
        self._raw, self._convert = raw, convert

    def __len__(self) -> int:
        return len(self._raw)

    def __iter__(self) -> Iterator[_T]:
        return map(self._convert, self._raw)

    @overload
    def __getitem__(self, index: int) -> _T: ...
    @overload
    def __getitem__(self, index: slice) -> list[_T]: ...
    def __getitem__(self, index: int | slice) -> _T | list[_T]:
        if isinstance(index, slice):
            return [self._convert(x) for x in self._raw[index]]
        return self._convert(self._raw[index])


@dataclass(frozen=True, slots=True)
class OpenRequest:
    request_id: str
    stop: Sequence[str] = ()
    include_stop_str: bool = False
    skip_special_tokens: bool = False
    prefix_ids: Sequence[int] = ()
    trace_context: Mapping[str, str] = field(default_factory=dict)   # W3C context of the request


@dataclass(frozen=True, slots=True)
class TokenBatch:
    request_id: str
    token_ids: Sequence[int]
    final: bool = False


@dataclass(frozen=True, slots=True)
class StreamBatch:
    opens: Sequence[OpenRequest] = ()
    tokens: Sequence[TokenBatch] = ()
    closes: Sequence[str] = ()
    # Token ids in `tokens`, when the caller counted them on the message (-1: count them here).
    ids: int = -1

    def token_ids(self) -> int:
        return self.ids if self.ids >= 0 else sum(len(t.token_ids) for t in self.tokens)

    def work(self) -> int:
        """A measure of the work in this batch, in tokens (module doc)."""
        return self.token_ids() + OPEN_COST * len(self.opens) + len(self.closes)


@dataclass(slots=True)
class _Applied:
    """What applying one batch has produced so far, and how far it has got (it may run in slices)."""

    outputs: list[Output] = field(default_factory=list)
    deltas: dict[str, Output] = field(default_factory=dict)   # the output of each request, to merge into
    phase: int = 0     # 0: opens, 1: tokens, 2: closes, 3: done
    index: int = 0     # the next item of the phase
    offset: int = 0    # in tokens: the next id of that item

    def result(self) -> list[Output]:
        return [o for o in self.outputs if o.text or o.finished or o.error]


@dataclass(slots=True)
class Output:
    request_id: str
    text: str = ""
    finished: bool = False
    matched_stop: str = ""
    # Generated tokens consumed so far; with a stop match: up to and including the completing one.
    tokens_consumed: int = 0
    error: str = ""


@dataclass(slots=True)
class DetokRequest:
    decoder: IncrementalDecoder
    stops: StopMatcher
    span: Span
    consumed: int = 0

    def end(self, outcome: str, error: str = "", matched_stop: str = "") -> None:
        metrics.DETOK_ENDED[outcome].inc()
        self.span.set_attributes({"tokenrelay.outcome": outcome, "tokenrelay.completion_tokens": self.consumed,
                                  "tokenrelay.matched_stop": matched_stop})
        if error:
            self.span.set_status(Status(StatusCode.ERROR, error))
        self.span.end()


@dataclass(eq=False)   # identity semantics: streams are tracked in weak sets
class DetokStream:
    """State of one stream. Not thread-safe: apply batches one at a time, in order."""

    tokenizer: LoadedTokenizer
    max_requests: int = 10_000
    _requests: dict[str, DetokRequest] = field(default_factory=dict)
    _finished: OrderedDict[str, None] = field(default_factory=OrderedDict)
    # Uncontended in normal use; it guards `close()` against a batch still running in a worker
    # thread after its call was cancelled.
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def open_requests(self) -> int:
        return len(self._requests)

    def close(self) -> None:
        """The stream ended: drop every request still open (their spans end as abandoned; for
        many, on a thread of their own, so that a stream closed with 10,000 open requests does
        not hold the event loop for the ~10 ms that ending their spans takes)."""
        with self._lock:
            requests, self._requests = self._requests, {}
            self._finished.clear()
        if len(requests) > CLOSE_INLINE:
            threading.Thread(target=_abandon, args=(list(requests.values()),), name="detok-close",
                             daemon=True).start()
        else:
            _abandon(requests.values())

    # -- one request at a time (a router detokenizing in its own process, router_svc/local_detok.py)
    def open(self, item: OpenRequest) -> str:
        """Open one request; an error code (Output.error's) or "" when it is open."""
        with self._lock:
            return self._open(item)

    def feed(self, item: TokenBatch) -> Output | None:
        """Apply one request's new ids; its output (None: nothing to say, e.g. trailing ids)."""
        with self._lock:
            return self._tokens(item)

    def plain(self, request_id: str) -> DetokRequest | None:
        """The state of an open request without stop strings, for `feed_one` (None: none such)."""
        req = self._requests.get(request_id)
        return req if req is not None and not req.stops.active else None

    def feed_one(self, request_id: str, req: DetokRequest, token_id: int) -> str | Output:
        """`feed` of one id that is not the request's last, for a request `plain` returned, by the one
        thread that feeds it: the text the id makes final (often ""), or the error `Output` that
        ends the request. No lock, no batch and no output object: a one-token delta's relay
        (router_svc/local_detok.py) pays ~half the CPU of `feed`. Its ids are not counted in
        DETOK_TOKENS: the caller counts them (`count`)."""
        if not 0 <= token_id < self.tokenizer.vocab_size:
            out = self.feed(TokenBatch(request_id, (token_id,)))
            return out if out is not None else ""
        if not req.consumed:
            req.span.add_event("first_tokens")
        try:
            text = req.decoder.step(token_id)
        except Exception:  # isolate one request's failure, as `_tokens` does
            log.exception("detokenize_failed", request_id=request_id)
            with self._lock:
                if self._requests.get(request_id) is req:
                    del self._requests[request_id]
                    self._remember_finished(request_id)
            req.end("error", Reason.INTERNAL)
            # The ids applied before this one, as the batch path's error counts them (`_advance`).
            return Output(request_id, finished=True, tokens_consumed=req.consumed, error=Reason.INTERNAL)
        req.consumed += 1
        return text

    @staticmethod
    def count(tokens: int) -> None:
        """Ids applied by `feed_one`, into DETOK_TOKENS."""
        metrics.DETOK_TOKENS.inc(tokens)

    def discard(self, request_id: str) -> None:
        """Drop a request that will get no more ids (its span ends as closed)."""
        with self._lock:
            self._close(request_id)

    def _close(self, request_id: str) -> None:
        closed = self._requests.pop(request_id, None)
        if closed is not None:
            closed.end("closed")
        self._finished.pop(request_id, None)

    def apply(self, batch: StreamBatch) -> list[Output]:
        """Apply the whole batch (opens, then tokens, then closes) and return its outputs."""
        applied = _Applied()
        self.apply_some(batch, applied, budget=0)
        return applied.result()

    def apply_some(self, batch: StreamBatch, applied: _Applied, budget: int) -> bool:
        """Go on applying `batch` for about `budget` work units (0: to the end); True once done."""
        with self._lock:
            left = budget or -1
            while applied.phase < 3 and left != 0:
                left = self._apply_phase(batch, applied, left)
            return applied.phase == 3

    def _apply_phase(self, batch: StreamBatch, applied: _Applied, left: int) -> int:
        if applied.phase == 0:
            count = len(batch.opens) - applied.index
            if left >= 0:
                count = min(count, max(1, left // OPEN_COST))
            for item in batch.opens[applied.index:applied.index + count]:
                error = self._open(item)
                if error:
                    applied.outputs.append(Output(item.request_id, finished=error != Reason.DUPLICATE_REQUEST_ID,
                                                  error=error))
            return self._advance_phase(applied, len(batch.opens), count, left, OPEN_COST * count)
        if applied.phase == 1:
            return self._apply_tokens(batch.tokens, applied, left)
        count = len(batch.closes) - applied.index
        if left >= 0:
            count = min(count, left)
        for request_id in batch.closes[applied.index:applied.index + count]:
            self._close(request_id)
        return self._advance_phase(applied, len(batch.closes), count, left, count)

    @staticmethod
    def _advance_phase(applied: _Applied, total: int, count: int, left: int, cost: int) -> int:
        applied.index += count
        if applied.index >= total:
            applied.phase, applied.index, applied.offset = applied.phase + 1, 0, 0
        return -1 if left < 0 else max(0, left - cost)

    def _apply_tokens(self, tokens: Sequence[TokenBatch], applied: _Applied, left: int) -> int:
        if left < 0:   # all at once (`apply`): nothing is cut
            for item in tokens if applied.index == 0 else tokens[applied.index:]:
                self._merge(applied, self._tokens(item))
            applied.phase, applied.index, applied.offset = 2, 0, 0
            return left
        # A slice: at most `left` items (each costs at least one unit), converted once.
        for item in tokens[applied.index:applied.index + left]:
            if left == 0:
                break
            ids, start = item.token_ids, applied.offset
            # A run of ids with an invalid one is refused whole, before any of it is decoded.
            take = len(ids) - start if start == 0 and not self._valid_ids(ids) else left
            end = min(len(ids), start + take)
            part = item if start == 0 and end == len(ids) else TokenBatch(
                item.request_id, ids[start:end], item.final and end == len(ids))
            self._merge(applied, self._tokens(part))
            left = max(0, left - max(1, end - start))
            if end >= len(ids):
                applied.index, applied.offset = applied.index + 1, 0
            else:
                applied.offset = end
        if applied.index >= len(tokens):
            applied.phase, applied.index, applied.offset = 2, 0, 0
        return left

    @staticmethod
    def _merge(applied: _Applied, out: Output | None) -> None:
        """One output per request: deltas of repeated items (or of one item's slices) are merged."""
        if out is None:
            return
        prev = applied.deltas.get(out.request_id)
        if prev is None or prev.finished:
            applied.deltas[out.request_id] = out
            applied.outputs.append(out)
        else:
            prev.text += out.text
            prev.finished, prev.matched_stop, prev.error = out.finished, out.matched_stop, out.error
            prev.tokens_consumed = out.tokens_consumed

    def _open(self, item: OpenRequest) -> str:
        if item.request_id in self._requests:
            return Reason.DUPLICATE_REQUEST_ID
        if len(self._requests) >= self.max_requests:
            return Reason.OVERLOADED
        if len(item.stop) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in item.stop):
            return Reason.INVALID_STOP
        tail = list(item.prefix_ids[-MAX_CONTEXT_TOKENS:])   # a 32k-id prompt is not copied
        if not self._valid_ids(tail):
            return Reason.INVALID_TOKEN_ID
        tok = self.tokenizer
        decoder = IncrementalDecoder(tok.decode, skip_special_tokens=item.skip_special_tokens,
                                     special_ids=tok.special_ids, prefix_ids=tail, token_bytes=tok.token_bytes)
        # One stream carries many traces: the request's own context is the parent, not the stream's.
        parent = recorded_parent(_tracer, item.trace_context)
        span = start_span(_tracer, "tokenizer.detokenize", context=parent, kind=SpanKind.SERVER,
                                  attributes={"tokenrelay.request_id": item.request_id,
                                              "tokenrelay.stop_strings": len(item.stop)})
        self._finished.pop(item.request_id, None)
        self._requests[item.request_id] = DetokRequest(decoder, StopMatcher(item.stop, item.include_stop_str), span)
        return ""

    def _tokens(self, item: TokenBatch) -> Output | None:
        rid = item.request_id
        req = self._requests.get(rid)
        if req is None:
            if rid in self._finished:
                if item.final:
                    del self._finished[rid]
                return None
            return Output(rid, finished=True, error=Reason.UNKNOWN_REQUEST)
        if not self._valid_ids(item.token_ids):
            self._requests.pop(rid)
            req.end("error", Reason.INVALID_TOKEN_ID)
            return Output(rid, finished=True, tokens_consumed=req.consumed, error=Reason.INVALID_TOKEN_ID)
        before = req.consumed
        if not before and item.token_ids:
            req.span.add_event("first_tokens")   # when the request's first ids were applied (TTFT breakdown)
        try:
            out = _advance(rid, req, item.token_ids, item.final)
        except Exception:  # isolate one request's failure from the stream's others
            log.exception("detokenize_failed", request_id=rid)
            out = Output(rid, finished=True, tokens_consumed=req.consumed, error=Reason.INTERNAL)
        metrics.DETOK_TOKENS.inc(req.consumed - before)
        if out.finished:
            del self._requests[rid]
            outcome = "error" if out.error else "stopped" if out.matched_stop else "finished"
            req.end(outcome, out.error, out.matched_stop)
            if not item.final:
                self._remember_finished(rid)
        return out

    def _valid_ids(self, ids: Sequence[int]) -> bool:
        return not ids or max(ids) < self.tokenizer.vocab_size

    def _remember_finished(self, request_id: str) -> None:
        self._finished[request_id] = None
        if len(self._finished) > FINISHED_MEMORY:
            self._finished.popitem(last=False)


def _abandon(requests: Iterable[DetokRequest]) -> None:
    for req in requests:
        req.end("abandoned")


def _advance(rid: str, req: DetokRequest, ids: Sequence[int], final: bool) -> Output:
    decoder, stops = req.decoder, req.stops
    if not stops.active:
        # No stop strings: no need to know which token produced which text.
        text = decoder.extend(ids)
        req.consumed += len(ids)
        if final:
            text += decoder.flush()
        return Output(rid, text, finished=final, tokens_consumed=req.consumed)
    parts: list[str] = []
    for token_id in ids:
        delta = decoder.step(token_id)
        req.consumed += 1     # after the step: an id whose decode failed is not counted (all paths alike)
        if delta:
            result = stops.feed(delta)
            parts.append(result.text)
            if result.matched is not None:
                return Output(rid, "".join(parts), finished=True, matched_stop=result.matched,
                              tokens_consumed=req.consumed)
    if final:
        result = stops.feed(decoder.flush())
        parts.append(result.text)
        if result.matched is None:
            parts.append(stops.flush())
        return Output(rid, "".join(parts), finished=True, matched_stop=result.matched or "",
                      tokens_consumed=req.consumed)
    return Output(rid, "".join(parts), tokens_consumed=req.consumed)



class Detokenizer:
    """Creates streams and runs their batches off the event loop; owns the worker threads."""

    def __init__(self, tokenizer: LoadedTokenizer, *, workers: int, max_requests_per_stream: int = 10_000,
                 inline_tokens: int = INLINE_TOKENS, slice_tokens: int = SLICE_TOKENS,
                 max_message_opens: int = MAX_MESSAGE_OPENS, max_message_tokens: int = MAX_MESSAGE_TOKENS) -> None:
        self.tokenizer = tokenizer
        self.max_requests_per_stream = max_requests_per_stream
        self.inline_tokens = inline_tokens
        self.slice_tokens = max(1, slice_tokens)
        self.max_message_opens = max_message_opens
        self.max_message_tokens = max_message_tokens
        self._workers = workers
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None

    async def start(self) -> None:
        self._executor = concurrent.futures.ThreadPoolExecutor(self._workers, thread_name_prefix="detok")

    async def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    def open_stream(self) -> DetokStream:
        """A new stream's state; `close()` it when the stream ends."""
        stream = DetokStream(self.tokenizer, max_requests=self.max_requests_per_stream)
        metrics.LOAD.add_stream(stream)
        return stream

    async def apply(self, stream: DetokStream, batch: StreamBatch) -> list[Output]:
        """The batch's outputs; raises BATCH_TOO_LARGE (the stream ends) for a batch over the bounds."""
        start = time.perf_counter()
        self._check_bounds(batch)
        work = batch.work()
        if self._executor is None or work <= self.inline_tokens:
            outputs = stream.apply(batch)
        elif work <= self.slice_tokens:   # one slice: applied whole, the cheapest way
            outputs = await asyncio.get_running_loop().run_in_executor(self._executor, stream.apply, batch)
        else:
            applied = _Applied()
            loop = asyncio.get_running_loop()
            while not await loop.run_in_executor(self._executor, stream.apply_some, batch, applied,
                                                 self.slice_tokens):
                pass
            outputs = applied.result()
        metrics.DETOK_MESSAGE_SECONDS.observe(time.perf_counter() - start)
        return outputs

    def _check_bounds(self, batch: StreamBatch) -> None:
        if len(batch.opens) > self.max_message_opens:
            raise Reason.BATCH_TOO_LARGE.error(
                f"{len(batch.opens)} opens in one Detokenize message; at most {self.max_message_opens}")
        ids = batch.token_ids()
        if ids > self.max_message_tokens:
            raise Reason.BATCH_TOO_LARGE.error(
                f"{ids} token ids in one Detokenize message; at most {self.max_message_tokens}")
