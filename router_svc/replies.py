"""The reply side of a request: client deltas made of the detokenizer's outputs, the final `done`,
and the two endings from outside the delta loop (its deadline and a Cancel).

`deltas()` is the per-token hot path: one wake-up per batch of outputs ready, their texts merged into
one client `Delta` (coarser when the client asked: `min_delta_tokens` / `min_delta_interval_ms`), a
move to another replica announced before the next delta. `router_svc/pipeline.py` runs it between
the engine stage's start and the `done`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from services.errors import Reason, in_band_error
from services.logging import get_logger

from .metrics import RequestMetrics
from .ports import Broken, DetokSessionPort, EngineStream
from .request import RequestState
from .types import Delta, DetokOut, Done, GenerateInput, Migrated

log = get_logger(__name__)


def coarse_ready(inp: GenerateInput, tokens: int, since_last: float) -> bool:
    """May a (non-first, non-final) delta be written now? Without options: always. With
    `min_delta_tokens` and/or `min_delta_interval_ms`: when either bound that is set is met."""
    min_tokens, min_gap_ms = inp.min_delta_tokens, inp.min_delta_interval_ms
    if not min_tokens and not min_gap_ms:
        return True
    return bool((min_tokens and tokens >= min_tokens) or (min_gap_ms and since_last * 1000 >= min_gap_ms))


@dataclass
class Merged:
    """The outputs of one `next_ready()`, merged into at most one client delta."""

    text: str = ""
    finished: bool = False
    matched_stop: str = ""
    tokens_consumed: int = 0


async def deltas(state: RequestState, detok: DetokSessionPort,
                 metrics: RequestMetrics) -> AsyncIterator[Delta | Migrated | Merged]:
    """Client deltas: every output ready merged into one; coarser when the client asked.
    A move to another replica is announced (`Migrated`) before the next delta. The last item
    is the final `Merged` (how the detokenizer ended).

    The per-token hot path: one wake-up, the merge, one `Delta`; nothing else is built."""
    inp, generated = state.inp, state.generated
    coarse = bool(inp.min_delta_tokens or inp.min_delta_interval_ms)
    want_ids = inp.return_token_ids
    pending = ""
    emitted = counted = migrations = 0
    last_write = 0.0
    while True:
        text, final = merge(await detok.next_ready(), state)
        if state.migrations > migrations:
            migrations = state.migrations
            yield Migrated(migrations, state.migration_tokens, state.migration_reason)
        if text:
            pending += text
        n = len(generated)
        limit = final.tokens_consumed if final is not None and final.matched_stop else n
        if not (pending or (want_ids and limit > emitted)):
            if final is not None:
                yield final
                return
            continue
        now = time.monotonic()
        if (final is not None or state.t_first is None or not coarse
                or coarse_ready(inp, n - counted, now - last_write)):
            new_ids = generated[emitted:limit] if want_ids else []
            emitted = max(emitted, limit)
            if state.t_first is None:
                state.t_first = now
                metrics.first_token(now)
            else:
                metrics.delta(now, n - counted)
            counted, last_write = n, now
            yield Delta(pending, new_ids)
            pending = ""
        if final is not None:
            yield final
            return


def done_event(state: RequestState, metrics: RequestMetrics, merged: Merged | None) -> Done:
    usage, timings = state.usage, state.timings
    usage.prompt_tokens = len(state.prompt_ids)
    if merged is not None and merged.matched_stop:
        usage.completion_tokens = merged.tokens_consumed
        reason, stop_reason = "stop", merged.matched_stop
    else:
        usage.completion_tokens = len(state.generated)
        reason, stop_reason = state.finish_reason, ""
    if state.is_cancelled:
        reason = "cancelled"
    now = time.monotonic()
    first = state.t_first if state.t_first is not None else now
    timings.ttft_seconds = first - state.t_arrival
    timings.total_seconds = now - state.t_arrival
    timings.decode_seconds = now - first
    metrics.done(reason, usage, timings)
    log.info("request_done", finish=reason, prompt_tokens=usage.prompt_tokens,
             completion_tokens=usage.completion_tokens, cached_tokens=usage.cached_tokens,
             ttft_ms=round(timings.ttft_seconds * 1000, 2), total_ms=round(timings.total_seconds * 1000, 2),
             claimed_ms=round((state.t_claimed - state.t_arrival) * 1000, 2) if state.t_claimed else None)
    return Done(reason, usage, timings, stop_reason)  # type: ignore[arg-type]


def merge(outs: list[DetokOut | Broken], state: RequestState) -> tuple[str, Merged | None]:
    """The text of the outputs ready, and how the detokenizer ended (None while it goes on)."""
    if len(outs) == 1:     # the common case (one output per wake-up): no list, no join
        out = outs[0]
        if type(out) is DetokOut and not out.error and not out.finished:
            return out.text, None
    texts: list[str] = []
    final: Merged | None = None
    for out in outs:
        if not isinstance(out, DetokOut):    # broken: the engine stage, a deadline or a cancel failed it
            if state.is_cancelled:
                final = Merged(finished=True)
                break
            raise out.error
        if out.error:  # an overload stays UNAVAILABLE (with a retry-after), the rest as registered
            raise in_band_error(out.error, "in-band error from the detokenizer", Reason.DETOKENIZER_ERROR)
        if out.text:
            texts.append(out.text)
        if out.finished:
            final = Merged(finished=True, matched_stop=out.matched_stop, tokens_consumed=out.tokens_consumed)
            break
    text = "".join(texts)
    if final is not None:
        final.text = text
    return text, final


class Ending:
    """The two ways a request ends from outside its loop, each one callback: its deadline (a
    timer) and a Cancel (the registry). Both abort the engine work and wake the delta loop by
    failing the detokenizer session."""

    def __init__(self, state: RequestState, detok: DetokSessionPort, engines: EngineStream) -> None:
        self._state, self._detok, self._engines = state, detok, engines
        loop = asyncio.get_running_loop()
        self._timer = loop.call_at(loop.time() + state.remaining(), self._on_deadline)

    def _abort(self) -> None:
        if self._state.replica and not self._state.engine_done:
            self._engines.abort(self._state.replica, self._state.upstream_id)
            self._state.engine_done = True   # nothing left to abort

    def _on_deadline(self) -> None:
        self._abort()
        self._detok.fail(Reason.DEADLINE_EXCEEDED.error("the request's deadline passed"))

    def on_cancel(self) -> None:
        self._state.cancel()
        self._abort()
        self._detok.fail(Reason.CANCELLED.error("cancelled"))

    def close(self) -> None:
        self._timer.cancel()


def stage_ended(state: RequestState, detok: DetokSessionPort) -> None:
    """However the engine stage ended, the delta loop must not wait for it any longer (its own
    failures reach the detokenizer first; this covers a stage cancelled from outside)."""
    if not state.engine_done:
        detok.fail(Reason.ENGINE_ERROR.error("the engine stage ended without a result"))
