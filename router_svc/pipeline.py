"""The path of one request: validate, tokenize, admit, route, generate, detokenize, finish.

`Router.generate()` is the single error boundary of a generation: cancellation (the client went
away, its deadline passed, or Cancel(request_id)) aborts the engine request, closes the
detokenizer state and releases the lease; typed errors propagate to the servicer's interceptor.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import structlog
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Status, StatusCode

from services.errors import Reason, TokenrelayError, in_band_error
from services.logging import get_logger
from services.mux import StreamBroken
from services.tracing import inject, tracer

from .admission import Admission, LeaseKeeper
from .metrics import IN_FLIGHT, QUEUED, RequestMetrics
from .tenants import Tenant
from .types import Accepted, Delta, Done, Event, GenerateInput, Timings, Usage
from .upstreams import DetokSession, EnginePool, EngineReplica, TokenizerUpstream
from .validation import check_lengths, validate_input

log = get_logger(__name__)
_tracer = tracer("tokenrelay.router")

# Prompt ids handed to the detokenizer for leading-space context.
_DETOK_CONTEXT = 8


@dataclass
class _RunState:
    """What the engine pump and the delta loop of one request share."""

    engine_done: bool = False
    flushed: bool = False
    reason: str = "length"


@dataclass
class _Live:
    tenant: str
    replica: EngineReplica | None = None
    cancelled: bool = False
    trace_ctx: Context | None = None


class Router:
    def __init__(self, tokenizer: TokenizerUpstream, engines: EnginePool, admission: Admission,
                 request_timeout: float, engine_attempts: int = 2) -> None:
        self.tokenizer = tokenizer
        self.engines = engines
        self.admission = admission
        self.request_timeout = request_timeout
        self.engine_attempts = engine_attempts
        self._live: dict[str, _Live] = {}

    @property
    def in_flight(self) -> int:
        return len(self._live)

    async def prompt_ids(self, tenant: Tenant, inp: GenerateInput, timeout: float | None) -> list[int]:
        if inp.token_ids is not None:
            return list(inp.token_ids)
        if inp.messages is not None:
            # Scoped by tenant: one tenant's session id can never reach another's cached prefix.
            key = f"{tenant.name}/{inp.session_id}" if inp.session_id else ""
            return await self.tokenizer.tokenize(messages=inp.messages, timeout=timeout, cache_key=key)
        return await self.tokenizer.tokenize(text=inp.prompt, timeout=timeout)

    def cancel(self, tenant: Tenant, request_id: str) -> bool:
        live = self._live.get(request_id)
        # Another tenant's id is reported exactly like an unknown one: nothing leaks.
        if live is None or live.tenant != tenant.name:
            return False
        live.cancelled = True
        if live.replica is not None:
            live.replica.abort(request_id)
        return True

    async def generate(self, tenant: Tenant, inp: GenerateInput,
                       deadline: float | None = None) -> AsyncIterator[Event]:
        """Run one request; the metrics/trace/log boundary around `_generate`."""
        request_id = inp.request_id or uuid.uuid4().hex
        inp.request_id = request_id
        metrics = RequestMetrics(tenant.name, inp.priority or tenant.default_priority)
        # The root span is never made "current": this generator yields, and a context attached here
        # would be detached by whichever task closes it. Children get the context explicitly.
        span = _tracer.start_span("tokenrelay.generate", attributes={
            "tokenrelay.request_id": request_id, "tokenrelay.tenant": tenant.name})
        rctx = trace.set_span_in_context(span)
        structlog.contextvars.bind_contextvars(request_id=request_id, tenant=tenant.name,
                                               trace_id=format(span.get_span_context().trace_id, "032x"))
        IN_FLIGHT.labels(tenant.name).inc()
        finished = False
        try:
            async for event in self._generate(tenant, inp, deadline, metrics, rctx):
                finished = isinstance(event, Done)
                yield event
        except TokenrelayError as exc:
            metrics.failed("error", exc.reason)
            span.set_status(Status(StatusCode.ERROR, exc.reason))
            log.info("request_failed", reason=exc.reason, message=exc.message)
            raise
        except (asyncio.CancelledError, GeneratorExit):
            if not finished:  # a consumer closing us after `done` is not a cancellation
                metrics.failed("cancelled", Reason.CLIENT_CANCELLED)
                log.info("request_cancelled_by_client")
            raise
        finally:
            IN_FLIGHT.labels(tenant.name).dec()
            structlog.contextvars.unbind_contextvars("request_id", "tenant", "trace_id")
            span.end()

    async def _generate(self, tenant: Tenant, inp: GenerateInput, deadline: float | None,
                        metrics: RequestMetrics, rctx: Context) -> AsyncIterator[Event]:
        t0 = time.monotonic()
        validate_input(inp, self.tokenizer.meta)
        tenant.check_model(inp.model)
        tenant.resolve_priority(inp.priority)
        request_id = inp.request_id
        if request_id in self._live:
            raise Reason.DUPLICATE_REQUEST_ID.error(f"request id {request_id!r} is already in flight")
        remaining = (deadline - time.monotonic()) if deadline else self.request_timeout
        with _tracer.start_as_current_span("tokenize", context=rctx):
            ids = await self.prompt_ids(tenant, inp, remaining)
        t_tok = time.monotonic()
        check_lengths(ids, inp.sampling, tenant, self._max_context())
        live = self._live[request_id] = _Live(tenant.name, trace_ctx=rctx)
        try:
            yield Accepted(request_id, len(ids))
            QUEUED.labels(tenant.name).inc()
            try:
                with _tracer.start_as_current_span("queue_wait", context=rctx):
                    await self.admission.acquire(tenant.name, request_id, tenant.max_in_flight)
            finally:
                QUEUED.labels(tenant.name).dec()
            timings = Timings(tokenize_seconds=t_tok - t0, queue_seconds=time.monotonic() - t_tok)
            async with LeaseKeeper(self.admission, tenant.name, request_id):
                async for event in self._run(request_id, tenant, inp, ids, live, timings, t0, metrics):
                    yield event
        finally:
            self._live.pop(request_id, None)

    def _max_context(self) -> int:
        meta = self.tokenizer.meta
        contexts = [c for c in (self.engines.max_context, meta.max_context if meta else 0) if c]
        return min(contexts) if contexts else 0

    async def _run(self, request_id: str, tenant: Tenant, inp: GenerateInput, ids: list[int],
                   live: _Live, timings: Timings, t0: float, metrics: RequestMetrics) -> AsyncIterator[Event]:
        eos = list(self.tokenizer.meta.eos_token_ids) if self.tokenizer.meta else []
        detok = self.tokenizer.detokenizer(request_id)
        detok.start(inp.sampling.stop, inp.sampling.include_stop_str, ids[-_DETOK_CONTEXT:], inject(live.trace_ctx))
        generated: list[int] = []
        usage = Usage(prompt_tokens=len(ids))
        state = _RunState()
        pump = asyncio.create_task(self._pump(request_id, tenant, inp, ids, eos, live, detok, generated,
                                              usage, state))
        emitted = counted = 0
        t_first: float | None = None
        try:
            while True:
                out = await detok.next()
                if isinstance(out, StreamBroken):
                    raise out.error
                if out.error:  # an overload stays UNAVAILABLE (with a retry-after), the rest as registered
                    raise in_band_error(out.error, "in-band error from the detokenizer", Reason.DETOKENIZER_ERROR)
                limit = out.tokens_consumed if out.matched_stop else len(generated)
                new_ids = generated[emitted:limit] if inp.return_token_ids else []
                emitted = max(emitted, limit)
                if out.text or new_ids:
                    now = time.monotonic()
                    if t_first is None:
                        t_first = now
                        metrics.first_token(now)
                    else:
                        metrics.delta(now, len(generated) - counted)
                    counted = len(generated)
                    yield Delta(out.text, new_ids)
                if out.finished:
                    state.flushed = True
                    break
            if out.matched_stop:
                usage.completion_tokens = out.tokens_consumed
                reason, stop_reason = "stop", out.matched_stop
            else:
                await pump  # the engine finished: its last chunk set the reason
                usage.completion_tokens = len(generated)
                reason, stop_reason = state.reason, ""
                if live.cancelled:
                    reason = "cancelled"
            now = time.monotonic()
            first = t_first if t_first is not None else now
            timings.ttft_seconds = first - t0
            timings.total_seconds = now - t0
            timings.decode_seconds = now - first
            metrics.done(reason, usage, timings)  # type: ignore[arg-type]
            log.info("request_done", finish=reason, prompt_tokens=usage.prompt_tokens,
                     completion_tokens=usage.completion_tokens, cached_tokens=usage.cached_tokens,
                     ttft_ms=round(timings.ttft_seconds * 1000, 2), total_ms=round(timings.total_seconds * 1000, 2))
            yield Done(reason, usage, timings, stop_reason)  # type: ignore[arg-type]
        finally:
            pump.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await pump
            if not state.engine_done and live.replica is not None:
                live.replica.abort(request_id)
            if live.replica is not None:
                live.replica.release(request_id)
            detok.close(flushed=state.flushed)

    async def _pump(self, request_id: str, tenant: Tenant, inp: GenerateInput, ids: list[int],
                    eos: list[int], live: _Live, detok: DetokSession, generated: list[int],
                    usage: Usage, state: _RunState) -> None:
        """Engine → detokenizer. Before any token, a broken stream or an error the registry marks
        retryable is retried on another replica (`engine_attempts` in all)."""
        tried: set[str] = set()
        last_error: TokenrelayError | None = None   # of the attempt being retried
        phase = None
        prefilling = False
        try:
            while True:
                with _tracer.start_as_current_span("route", context=live.trace_ctx) as route_span:
                    try:
                        replica = self.engines.pick(inp.session_id, frozenset(tried))
                    except TokenrelayError:
                        if last_error is not None:  # no other replica: the client hears why the last one failed
                            raise last_error from None
                        raise
                    route_span.set_attribute("tokenrelay.replica", replica.address)
                live.replica = replica
                tried.add(replica.address)
                phase, prefilling = _tracer.start_span("prefill", context=live.trace_ctx), True
                ctx = trace.set_span_in_context(phase)
                queue = replica.submit(request_id, ids, inp.sampling, eos, tenant.name, inject(ctx))
                while True:
                    chunk = await queue.get()
                    if prefilling and not isinstance(chunk, StreamBroken) and chunk.token_ids:
                        phase.end()
                        phase, prefilling = _tracer.start_span("decode", context=live.trace_ctx), False
                    if isinstance(chunk, StreamBroken):
                        replica.release(request_id)
                        if generated or len(tried) >= self.engine_attempts or live.cancelled:
                            raise chunk.error
                        self.engines.mark_failed(replica)
                        log.warning("engine_retry", request_id=request_id, failed=replica.address)
                        last_error = chunk.error
                        break
                    if chunk.error_reason:
                        error = in_band_error(chunk.error_reason, chunk.error_message, Reason.ENGINE_ERROR)
                        if generated or not error.retryable or len(tried) >= self.engine_attempts or live.cancelled:
                            state.engine_done = True
                            raise error
                        # The engine ended this attempt (e.g. OVERLOADED): the replica is healthy, just busy.
                        replica.release(request_id)
                        log.warning("engine_retry", request_id=request_id, failed=replica.address,
                                    reason=error.reason)
                        last_error = error
                        break
                    if chunk.cached_tokens:
                        usage.cached_tokens = chunk.cached_tokens
                    generated.extend(chunk.token_ids)
                    if chunk.finished:
                        state.engine_done = True
                        state.reason = chunk.finish_reason or "length"
                    detok.send(chunk.token_ids, final=chunk.finished)
                    if chunk.finished:
                        return
        except TokenrelayError as exc:
            detok.fail(exc)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - surfaced to the request, never swallowed
            detok.fail(Reason.ENGINE_ERROR.error(f"engine pump failed: {exc!r}"))
        finally:
            if phase is not None:
                phase.end()


class Sessions:
    """Chat sessions: per-session conversation, owned by one tenant."""

    def __init__(self) -> None:
        self._owners: dict[str, str] = {}

    def claim(self, tenant: Tenant, session_id: str) -> str:
        session_id = session_id or uuid.uuid4().hex
        owner = self._owners.setdefault(session_id, tenant.name)
        if owner != tenant.name:
            raise Reason.UNKNOWN_SESSION.error("unknown session")
        return session_id

    def drop(self, session_id: str) -> None:
        self._owners.pop(session_id, None)
