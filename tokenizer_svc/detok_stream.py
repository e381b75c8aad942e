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
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from services.errors import Reason
from services.logging import get_logger
from services.tracing import extract, tracer
from tokenizer_svc import metrics
from tokenizer_svc.detokenizer import MAX_CONTEXT_TOKENS, IncrementalDecoder
from tokenizer_svc.loader import LoadedTokenizer
from tokenizer_svc.stop_strings import StopMatcher

log = get_logger(__name__)
_tracer = tracer("tokenrelay.tokenizer")

# Ids of recently finished requests, so trailing tokens sent before the engine saw the stop are
# ignored rather than reported as unknown.
FINISHED_MEMORY = 4096
# Stop matching costs O(total stop length) per token; bound what one request may ask for.
MAX_STOPS = 64
MAX_STOP_CHARS = 1024
# Batches this small cost less than a hop to a worker thread (~50 µs), so they run inline.
INLINE_TOKENS = 16


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

    def token_count(self) -> int:
        """A measure of the work in this batch (only a prompt's tail is ever looked at)."""
        return (sum(len(t.token_ids) for t in self.tokens)
                + sum(min(len(o.prefix_ids), MAX_CONTEXT_TOKENS) for o in self.opens))


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
class _Request:
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
    _requests: dict[str, _Request] = field(default_factory=dict)
    _finished: OrderedDict[str, None] = field(default_factory=OrderedDict)
    # Uncontended in normal use; it guards `close()` against a batch still running in a worker
    # thread after its call was cancelled.
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def open_requests(self) -> int:
        return len(self._requests)

    def close(self) -> None:
        """The stream ended: drop every request still open (their spans end as abandoned)."""
        with self._lock:
            for req in self._requests.values():
                req.end("abandoned")
            self._requests.clear()
            self._finished.clear()

    def apply(self, batch: StreamBatch) -> list[Output]:
        with self._lock:
            return self._apply(batch)

    def _apply(self, batch: StreamBatch) -> list[Output]:
        outputs: list[Output] = []
        for item in batch.opens:
            error = self._open(item)
            if error:
                outputs.append(Output(item.request_id, finished=error != Reason.DUPLICATE_REQUEST_ID, error=error))
        deltas: dict[str, Output] = {}   # one output per request: deltas of repeated items are merged
        for tokens in batch.tokens:
            out = self._tokens(tokens)
            if out is None:
                continue
            prev = deltas.get(out.request_id)
            if prev is None or prev.finished:
                deltas[out.request_id] = out
                outputs.append(out)
            else:
                prev.text += out.text
                prev.finished, prev.matched_stop, prev.error = out.finished, out.matched_stop, out.error
                prev.tokens_consumed = out.tokens_consumed
        for request_id in batch.closes:
            closed = self._requests.pop(request_id, None)
            if closed is not None:
                closed.end("closed")
            self._finished.pop(request_id, None)
        return [o for o in outputs if o.text or o.finished or o.error]

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
        parent = extract(item.trace_context) if item.trace_context else None
        span = _tracer.start_span("tokenizer.detokenize", context=parent, kind=SpanKind.SERVER,
                                  attributes={"tokenrelay.request_id": item.request_id,
                                              "tokenrelay.stop_strings": len(item.stop)})
        self._finished.pop(item.request_id, None)
        self._requests[item.request_id] = _Request(decoder, StopMatcher(item.stop, item.include_stop_str), span)
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


def _advance(rid: str, req: _Request, ids: Sequence[int], final: bool) -> Output:
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
        req.consumed += 1
        delta = decoder.step(token_id)
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
                 inline_tokens: int = INLINE_TOKENS) -> None:
        self.tokenizer = tokenizer
        self.max_requests_per_stream = max_requests_per_stream
        self.inline_tokens = inline_tokens
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
        start = time.perf_counter()
        if self._executor is None or batch.token_count() <= self.inline_tokens:
            outputs = stream.apply(batch)
        else:
            outputs = await asyncio.get_running_loop().run_in_executor(self._executor, stream.apply, batch)
        metrics.DETOK_MESSAGE_SECONDS.observe(time.perf_counter() - start)
        return outputs
