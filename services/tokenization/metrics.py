"""Tokenizer metrics (Prometheus). Every name starts with `tokenrelay_tokenizer_`.

| metric | type | labels | meaning |
| --- | --- | --- | --- |
| `tokenize_seconds` | histogram | | Tokenize call, validation to result (queueing included) |
| `tokenize_inputs_total` | counter | `kind` (text, chat) | inputs of accepted calls |
| `tokenize_tokens_total` | counter | | ids produced |
| `tokenize_rejections_total` | counter | `reason` | refused calls (EMPTY_PROMPT, PROMPT_TOO_LONG, OVERLOADED, ...) |
| `tokenize_batch_inputs` | histogram | | inputs per encode_batch run (how much batching happens) |
| `chat_reused_tokens_total` | counter | | chat tokens reused from the session's previous turn instead of re-tokenized |
| `chat_cache_fallbacks_total` | counter | | incremental chat tokenizations that fell back to the whole text |
| `tokenize_pending_inputs` | gauge | | inputs queued or running (read at scrape time) |
| `detok_streams` | gauge | | open Detokenize streams (read at scrape time) |
| `detok_open_requests` | gauge | | requests open on them (read at scrape time) |
| `detok_tokens_total` | counter | | generated tokens detokenized |
| `detok_requests_total` | counter | `outcome` (finished, stopped, closed, error, abandoned) | requests that ended |
| `detok_message_seconds` | histogram | | processing of one inbound Detokenize message |

Counters are incremented with children built once here; gauges are computed from the live
encoders and streams when /metrics is scraped, so the hot path pays nothing for them.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from typing import Protocol

from prometheus_client import REGISTRY, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from services.metrics import FAST_BUCKETS

_P = "tokenrelay_tokenizer_"
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)

TOKENIZE_SECONDS = Histogram(_P + "tokenize_seconds", "Tokenize call, validation to result (queueing "
                             "included)", buckets=FAST_BUCKETS)
_INPUTS = Counter(_P + "tokenize_inputs_total", "Inputs of accepted Tokenize calls", ["kind"])
TEXT_INPUTS = _INPUTS.labels("text")
CHAT_INPUTS = _INPUTS.labels("chat")
TOKENS = Counter(_P + "tokenize_tokens_total", "Token ids produced by Tokenize")
_REJECTIONS = Counter(_P + "tokenize_rejections_total", "Tokenize calls refused, by reason", ["reason"])
CHAT_REUSED_TOKENS = Counter("tokenrelay_tokenizer_chat_reused_tokens_total",
                             "Chat tokens reused from the previous turn instead of re-tokenized")
CHAT_CACHE_FALLBACKS = Counter("tokenrelay_tokenizer_chat_cache_fallbacks_total",
                               "Incremental chat tokenizations that fell back to the whole text")
BUSY_SECONDS = Counter(_P + "tokenize_busy_seconds_total", "Seconds worker threads spent encoding batches "
                       "(utilization = rate / tokenize_workers)")
BATCH_INPUTS = Histogram(_P + "tokenize_batch_inputs", "Inputs per encode_batch run", buckets=BATCH_BUCKETS)
DETOK_TOKENS = Counter(_P + "detok_tokens_total", "Generated tokens detokenized")
_DETOK_REQUESTS = Counter(_P + "detok_requests_total", "Detokenize requests that ended, by outcome "
                          "(finished, stopped, closed, error, abandoned)", ["outcome"])
DETOK_ENDED = {o: _DETOK_REQUESTS.labels(o) for o in ("finished", "stopped", "closed", "error", "abandoned")}
DETOK_MESSAGE_SECONDS = Histogram(_P + "detok_message_seconds", "Processing of one inbound Detokenize "
                                  "message", buckets=FAST_BUCKETS)
_rejections: dict[str, Counter] = {}


def count_rejection(reason: str) -> None:
    child = _rejections.get(reason)
    if child is None:
        child = _rejections[reason] = _REJECTIONS.labels(reason)
    child.inc()


class _HasPending(Protocol):
    @property
    def pending(self) -> int: ...

    workers: int


class _HasOpenRequests(Protocol):
    @property
    def open_requests(self) -> int: ...


class LoadCollector(Collector):
    """Gauges computed from the live encoders' batchers and detokenize streams at scrape time."""

    def __init__(self) -> None:
        # Weak: a stream disappears from the gauge when its call ends and the object goes.
        # The lock because the event loop adds while the HTTP thread collects.
        self._encoders: weakref.WeakSet[_HasPending] = weakref.WeakSet()  # type: ignore[type-var]
        self._streams: weakref.WeakSet[_HasOpenRequests] = weakref.WeakSet()  # type: ignore[type-var]
        self._lock = threading.Lock()

    def add_encoder(self, encoder: _HasPending) -> None:
        with self._lock:
            self._encoders.add(encoder)

    def add_stream(self, stream: _HasOpenRequests) -> None:
        with self._lock:
            self._streams.add(stream)

    def describe(self) -> Iterator[Metric]:
        return self._families([], [])

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            encoders, streams = list(self._encoders), list(self._streams)
        return self._families(encoders, streams)

    def _families(self, encoders: list[_HasPending], streams: list[_HasOpenRequests]) -> Iterator[Metric]:
        yield GaugeMetricFamily(_P + "tokenize_pending_inputs", "Tokenize inputs queued or running",
                                value=sum(e.pending for e in encoders))
        yield GaugeMetricFamily(_P + "tokenize_workers", "Worker threads that encode batches",
                                value=sum(e.workers for e in encoders))
        yield GaugeMetricFamily(_P + "detok_streams", "Open Detokenize streams", value=len(streams))
        yield GaugeMetricFamily(_P + "detok_open_requests", "Requests open on Detokenize streams",
                                value=sum(s.open_requests for s in streams))


LOAD = LoadCollector()
REGISTRY.register(LOAD)
