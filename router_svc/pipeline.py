"""The path of one request, over ports: gate, validate, claim id, tokenize, admit, engine, deltas, done.

`Router.generate()` is the single error boundary of a generation. Its state lives in one
`RequestState`; the stages are methods that read and update it. The engine stage (attempts,
retries, progress timeout) runs as one task feeding the detokenizer; the delta loop here merges
every output ready into one client `Delta` per write.

Ending: every request ends by its deadline (the client's, else `request_timeout`) with
DEADLINE_EXCEEDED, and a Cancel (from any router, through the `RequestRegistry`) ends it with
`done(cancelled)`; both abort the engine work, close the detokenizer state and settle the lease.
The deadline and the cancel cost nothing per token: each is one callback that fails the
detokenizer session, which wakes the delta loop.

This module imports no gRPC and no adapter: `app.py` wires the ports (`ports.py`).
"""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import structlog
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Status, StatusCode

from services.errors import Reason, TokenrelayError
from services.logging import get_logger
from services.tasks import discard, retrieve
from services.tracing import child_span, detached_span, inject, tracer

from .admission_steps import BUDGET_REFUSALS, abandon_early, end_admission, final_refusal
from .cache_key import tokenize_cache_key
from .engine_stage import EngineStage
from .metrics import QUEUED, REFUSAL, RequestMetrics
from .placement import LeastLoaded, LocalSessionAffinity
from .ports import (
    Admission,
    AdmitRequest,
    Admitting,
    Detokenize,
    EngineStream,
    LoadGate,
    Placement,
    PoolSelector,
    RequestRegistry,
    SessionAffinity,
    Shadow,
    Tokenize,
)
from .replies import Ending, Merged, deltas, done_event, stage_ended
from .request import LocalRequestRegistry, PromptEstimate, RequestState
from .tenants import Tenant, tenant_limits
from .types import Accepted, Delta, Done, Event, GenerateInput, Migrated
from .validation import DEFAULT_BOUNDS, MAX_REQUEST_ID, Bounds, check_lengths, validate_input

log = get_logger(__name__)
_tracer = tracer("tokenrelay.router")

# Prompt ids handed to the detokenizer for leading-space context.
_DETOK_CONTEXT = 8
# Loop turns the `Accepted` of a request granted at once waits for its submit to the engine (`_run`).
_SUBMIT_TURNS = 2


class _OpenGate:
    class _T:
        def exit(self) -> None:
            return None

    _ticket = _T()

    def enter(self) -> _T:
        return self._ticket


@dataclass
class RouterOptions:
    request_timeout: float = 600.0
    engine_attempts: int = 2
    progress_timeout: float = 10.0
    bounds: Bounds = DEFAULT_BOUNDS
    default_max_queued: int = 256     # a tenant's max_queued when its entry sets none
    engine_migrations: int = 2        # moves to another replica after the first token
    admit_while_tokenizing: bool = True   # admission on an estimated prompt, alongside Tokenize
    # A finished chat turn's conversation, its reply included, tokenized ahead of the next turn while
    # this router has at most this many requests in flight (0 = never; `Router._prefetch`).
    chat_prefetch_max_in_flight: int = 32


@dataclass
class Ports:
    tokenizer: Tokenize
    detokenize: Detokenize
    engines: EngineStream
    admission: Admission
    placement: Placement = field(default_factory=LeastLoaded)
    affinity: SessionAffinity = field(default_factory=LocalSessionAffinity)
    registry: RequestRegistry = field(default_factory=LocalRequestRegistry)
    gate: LoadGate = field(default_factory=_OpenGate)
    pools: PoolSelector | None = None
    shadow: Shadow | None = None


def _prompt(tenant: Tenant, inp: GenerateInput) -> dict[str, Any]:
    """A text or chat prompt as the tokenizer port's keywords (a chat's with its prefix-cache key)."""
    if inp.messages is not None:
        return {"messages": inp.messages, "allow_special_tokens": tenant.allow_control_tokens,
                "cache_key": tokenize_cache_key(tenant.name, inp.session_id, inp.messages)}
    return {"text": inp.prompt, "allow_special_tokens": tenant.allow_control_tokens}


class Router:
    def __init__(self, ports: Ports, options: RouterOptions | None = None) -> None:
        self.ports = ports
        self.options = options or RouterOptions()
        o = self.options
        self.stage = EngineStage(ports.engines, ports.placement, ports.affinity, o.engine_attempts,
                                 o.progress_timeout, o.engine_migrations, ports.pools, ports.shadow)
        self._live: dict[tuple[str, str], RequestState] = {}
        self._unclaiming: set[asyncio.Future[None]] = set()     # claims given back after a refusal
        self.estimate = PromptEstimate()

    @property
    def in_flight(self) -> int:
        return len(self._live)

    def live(self, tenant: str, request_id: str) -> RequestState | None:
        """The state of a request this process serves (introspection and tests)."""
        return self._live.get((tenant, request_id))

    async def cancel(self, tenant: Tenant, request_id: str) -> bool:
        # Another tenant's id is reported exactly like an unknown one: nothing leaks.
        if len(request_id) > MAX_REQUEST_ID:
            raise Reason.INVALID_REQUEST_ID.error(f"request_id longer than {MAX_REQUEST_ID}")
        cancelled = await self.ports.registry.cancel(tenant.name, request_id)
        # When it was answered, and how: with each request's claim and end (request_done), the
        # order of events for an id on every router (bench/probe_mix.py reads them).
        log.info("cancel_answered", tenant=tenant.name, request_id=request_id, cancelled=cancelled)
        return cancelled

    async def generate(self, tenant: Tenant, inp: GenerateInput, deadline: float | None = None,
                       t_arrival: float | None = None) -> AsyncIterator[Event]:
        """Run one request; the gate/metrics/trace/log boundary around `_generate`."""
        now = time.monotonic()
        ticket = self.ports.gate.enter()   # refuses (UNAVAILABLE) before any work when overloaded
        try:
            inp.request_id = inp.request_id or uuid.uuid4().hex
            state = RequestState(tenant.name, inp.request_id, inp, inp.priority or tenant.default_priority,
                                 deadline if deadline is not None else now + self.options.request_timeout,
                                 t_arrival if t_arrival is not None else now)
            async for event in self._observed(tenant, state):
                yield event
        finally:
            ticket.exit()

    async def _observed(self, tenant: Tenant, state: RequestState) -> AsyncIterator[Event]:
        metrics = RequestMetrics(tenant.name, state.priority)
        # The root span is never made "current": this generator yields, and a context attached here
        # would be detached by whichever task closes it. Children get the context explicitly.
        # It starts when the call arrived (before the handler ran), like the TTFT it measures.
        arrived_ns = time.time_ns() - int(max(0.0, time.monotonic() - state.t_arrival) * 1e9)
        span = _tracer.start_span("tokenrelay.generate", start_time=arrived_ns, attributes={
            "tokenrelay.request_id": state.request_id, "tokenrelay.tenant": tenant.name})
        rctx = trace.set_span_in_context(span)
        structlog.contextvars.bind_contextvars(request_id=state.request_id, tenant=tenant.name,
                                               trace_id=format(span.get_span_context().trace_id, "032x"))
        in_flight = metrics.children.in_flight
        in_flight.inc()
        finished = first = answered = False
        try:
            async for event in self._generate(tenant, state, metrics, rctx):
                answered = True
                finished = isinstance(event, Done)
                if not first and isinstance(event, Delta):
                    first = True
                    span.add_event("first_delta")   # the TTFT breakdown's last mark (bench/ttft_breakdown.py)
                yield event
        except TokenrelayError as exc:
            metrics.failed("error", exc.reason)
            if not answered:
                REFUSAL.labels(exc.reason).observe(time.monotonic() - state.t_arrival)
            span.set_status(Status(StatusCode.ERROR, exc.reason))
            log.info("request_failed", reason=exc.reason, message=exc.message)
            raise
        except (asyncio.CancelledError, GeneratorExit):
            if not finished:  # a consumer closing us after `done` is not a cancellation
                metrics.failed("cancelled", Reason.CLIENT_CANCELLED)
                log.info("request_cancelled_by_client")
            raise
        finally:
            metrics.flush()
            in_flight.dec()
            structlog.contextvars.unbind_contextvars("request_id", "tenant", "trace_id")
            span.end()

    async def _generate(self, tenant: Tenant, state: RequestState, metrics: RequestMetrics,
                        rctx: Context) -> AsyncIterator[Event]:
        inp, registry = state.inp, self.ports.registry
        validate_input(inp, self.ports.tokenizer.meta, self.options.bounds)
        tenant.check_model(inp.model)
        tenant.resolve_priority(inp.priority)
        state.check_deadline()
        # A tenant far past its token budget is refused here, before its id is claimed or its prompt
        # tokenized, when admission already knows Redis would refuse it (router_svc/budget_memo.py).
        # Its least cost: an admitted prompt has a token at least, and an omitted max_tokens (0) becomes 1 or more.
        least = max(1, len(inp.token_ids or ())) + max(1, inp.sampling.max_tokens)
        self.ports.admission.precheck(self._admit_request(tenant, state, least))
        # The prompt is tokenized while the id claim (a Redis round trip with several routers) is
        # answered, and — on an estimate of its prompt — admitted meanwhile too (`_early`): nothing
        # reaches the client or an engine before the three are done. The claim is taken before its
        # first await: a second identical id of this tenant fails, the first runs. An early
        # admission's queue entry is this request's own (the admission names entries by a nonce),
        # so a duplicate's never touches the first's.
        # The early admission first: its ENQUEUE is on its way before an encode in this process
        # (router_svc/local_tokenize.py) holds the loop.
        estimate, early, refused_on_estimate = self._early(tenant, state, rctx)
        # The id claim next (a round trip raced with the early admission, when there is one), then the
        # prompt's tokenization: each writes its Redis call in its first step, in this order, so both
        # calls are on their way before an encode in this process holds the loop.
        claiming = (asyncio.ensure_future(self.ports.registry.claim(tenant.name, state.request_id))
                    if early is not None and self.ports.registry.remote else None)
        # The session's replica next, fetched meanwhile (placement reads it): before the tokenization,
        # whose one loop turn before an encode lets the cluster pipeline's sender write the lookup then
        # (after the claim, whose write keeps the connection busy). Started after it, the lookup went out
        # after the encode, and 12-20% of chat turns were granted before it was answered and waited for it.
        if inp.session_id:
            state.sticky = asyncio.ensure_future(self.ports.affinity.get(tenant.name, inp.session_id))
            state.sticky.add_done_callback(retrieve)   # the request may end before placement reads it
        if refused_on_estimate and self._tokenize_now(tenant, state):
            # Tokenized here and now (nothing to overlap): a refusal on its real count is decided in
            # this loop turn, as the estimate's was.
            tokenizing: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            tokenizing.set_result(None)
        else:
            tokenizing = asyncio.ensure_future(self._tokenize(tenant, state, rctx))
        if refused_on_estimate:
            # Its tenant's budget refuses it on its estimate: decided on its real count first, and
            # refused then without the id claim's round trip (a duplicate of its id that arrives
            # meanwhile may claim the id first, one of the two is refused either way; a Cancel
            # RPC meanwhile finds no such request, as one sent before the request arrived).
            await self._tokenized(tenant, state, tokenizing)
            self.ports.admission.precheck(self._admit_request(tenant, state, state.cost))
        try:
            claimed = await self._claimed(tenant, state, tokenizing, early, claiming)
        except BaseException:
            await abandon_early(tokenizing, early, state)
            raise
        if not claimed:
            await abandon_early(tokenizing, early, state)
            raise Reason.DUPLICATE_REQUEST_ID.error(f"request id {state.request_id!r} is already in flight")
        state.t_claimed = time.monotonic()
        self._live[state.key] = state
        done: Done | None = None
        ended = False
        try:
            registry.on_cancel(tenant.name, state.request_id, state.cancel)
            admitting = await self._tokenized_and_admitted(tenant, state, tokenizing, estimate, early, rctx)
            # From here on the queue entry or the lease is given back on every path: the client may
            # go away at any yield, a grant may land while a cancel is on its way.
            try:
                first = Accepted(state.request_id, len(state.prompt_ids), admitting.position)
                accepted: Accepted | None = first
                if admitting.grant is None:
                    yield first
                    accepted = None
                    async for event in self._queued(state, admitting, rctx):
                        yield event
                state.t_admitted = time.monotonic()
                state.timings.queue_seconds = max(0.0, state.t_admitted - state.t_arrival
                                                  - state.timings.tokenize_seconds)
                # Granted at once: `_run` starts the engine stage and yields the `Accepted` once the
                # submit is on its way to the engine (the engine's work starts first).
                async for event in self._run(state, metrics, rctx, accepted):
                    if isinstance(event, Done):
                        done = event
                    else:
                        yield event
            finally:
                await end_admission(admitting, state)
            ended = True
        finally:
            self._live.pop(state.key, None)
            # A request that ends with its `done` frees its id before the `done` goes out (the client
            # may reuse it at once, on any router); a refused or failed one does not wait for that
            # round trip: its status goes out now, and an id reused meanwhile is taken over from
            # this router, which no longer holds it (the registry's claim asks the owner).
            await registry.release(tenant.name, state.request_id, wait=ended)
        # `done` goes out after the lease and the id are released: a client that has its `done`
        # may reuse the id, or send its next request within its tenant's limit, at once.
        if done is not None:
            yield done
            self._prefetch(tenant, state, done)

    async def _claimed(self, tenant: Tenant, state: RequestState, tokenizing: asyncio.Future[None],
                       early: asyncio.Future[Admitting] | None, claiming: asyncio.Future[bool] | None) -> bool:
        """The request id's claim (a Redis round trip with several routers; `claiming`, started
        beside the early admission). An early admission refused for a reason its token count cannot
        change (a full queue, a concurrency limit) is the answer as soon as it comes back, without
        waiting for the claim: the claim, when it lands, is given back."""
        registry = self.ports.registry
        if claiming is None:    # nothing to race: no task, no loop turn
            return await registry.claim(tenant.name, state.request_id)
        assert early is not None
        try:
            await asyncio.wait((claiming, early), return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            claiming.cancel()
            raise
        if not claiming.done() and early.done() and final_refusal(early):
            claiming.add_done_callback(functools.partial(self._unclaim, tenant.name, state.request_id))
            await discard(tokenizing)
            early.result()          # raises the refusal
        try:
            return await claiming
        except asyncio.CancelledError:
            claiming.cancel()
            raise

    def _keeps_reply(self, inp: GenerateInput) -> bool:
        """Whether this request's reply is kept for `_prefetch`: a chat, a tokenizer port that can
        tokenize ahead, and prefetching on."""
        return (inp.messages is not None and self.options.chat_prefetch_max_in_flight > 0
                and hasattr(self.ports.tokenizer, "prefetch"))

    def _prefetch(self, tenant: Tenant, state: RequestState, done: Done) -> None:
        """After a chat turn's `done` is written: its conversation with the reply the client got,
        tokenized now under the key its next turn will use, so that the next turn encodes only what
        it adds (its new message) instead of the reply and the message, on its first token's path.
        The tokenizer's prefix cache decides what is reused by comparing texts, so a next turn that
        differs (an edited reply, a regenerated turn, no next turn) gets exact ids all the same; this
        costs an encode of the reply now instead of later, or in vain when no turn follows. Not while
        this router has more than `chat_prefetch_max_in_flight` requests in flight, this one included
        (it has left `_live` by now)."""
        inp = state.inp
        if (state.reply is None or inp.messages is None or done.finish_reason not in ("stop", "length")
                or len(self._live) >= self.options.chat_prefetch_max_in_flight):
            return
        messages = [*inp.messages, ("assistant", "".join(state.reply))]
        # In the next loop turn: the generator ends (and the call's status goes out) first.
        asyncio.get_running_loop().call_soon(functools.partial(
            self.ports.tokenizer.prefetch, messages=messages,  # type: ignore[attr-defined]
            cache_key=tokenize_cache_key(tenant.name, inp.session_id, messages),
            allow_special_tokens=tenant.allow_control_tokens))

    def _unclaim(self, tenant: str, request_id: str, claiming: asyncio.Future[bool]) -> None:
        """A claim that landed after its request was refused: given back."""
        if not claiming.cancelled() and claiming.exception() is None and claiming.result():
            release = asyncio.ensure_future(self.ports.registry.release(tenant, request_id, wait=False))
            self._unclaiming.add(release)
            release.add_done_callback(self._unclaiming.discard)
            release.add_done_callback(retrieve)

    def _early(self, tenant: Tenant, state: RequestState,
               rctx: Context) -> tuple[int | None, asyncio.Future[Admitting] | None, bool]:
        """The estimated prompt tokens and the admission started on them, with
        `admit_while_tokenizing` and an estimate (`PromptEstimate`; none for token-id input); and
        whether admission already knows its tenant's budget would refuse it on that estimate (then
        it is decided on its real count, `precheck`, without being sent meanwhile)."""
        estimate = self.estimate.tokens(state.inp) if self.options.admit_while_tokenizing else None
        if estimate is None:
            return None, None, False
        cost = estimate + state.inp.sampling.max_tokens
        if self.ports.admission.predicts_refusal(self._admit_request(tenant, state, cost)):
            return None, None, True
        return estimate, asyncio.ensure_future(self._enqueue(tenant, state, rctx, cost)), False

    async def _tokenized(self, tenant: Tenant, state: RequestState, tokenizing: asyncio.Future[None]) -> None:
        """The prompt tokenized and its lengths checked (the Tokenize stopped on every way out)."""
        try:
            await tokenizing
            check_lengths(state.prompt_ids, state.inp.sampling, tenant, self._max_context(), self.options.bounds)
        except BaseException:
            await discard(tokenizing)
            raise

    async def _tokenized_and_admitted(self, tenant: Tenant, state: RequestState, tokenizing: asyncio.Future[None],
                                      estimate: int | None, early: asyncio.Future[Admitting] | None,
                                      rctx: Context) -> Admitting:
        """The prompt tokenized and checked, and the request admitted (granted or queued). An early
        admission (`_early`) the request turns out not to need (tokenizing or its length checks
        failed, the client left) is given back at once; one refused for a reason its token count
        does not change (a full queue, a concurrency limit) is the answer at once, without waiting
        for Tokenize."""
        try:
            if early is not None and not tokenizing.done():
                await asyncio.wait((tokenizing, early), return_when=asyncio.FIRST_COMPLETED)
                if early.done() and not tokenizing.done() and final_refusal(early):
                    await discard(tokenizing)
                    early.result()          # raises the refusal
            await self._tokenized(tenant, state, tokenizing)
        except BaseException:
            # Also when cut off in `asyncio.wait`, which leaves the Tokenize task running.
            await abandon_early(tokenizing, early, state)
            raise
        if early is None or estimate is None:
            self.ports.admission.precheck(self._admit_request(tenant, state, state.cost))
            return await self._enqueue(tenant, state, rctx)
        try:
            return await early
        except TokenrelayError as exc:
            # Refused on the estimate's token count, which was above the real one: ask with the real
            # one, unless what the refusal told of the tenant's budget refuses that too.
            if exc.reason in BUDGET_REFUSALS and len(state.prompt_ids) < estimate:
                self.ports.admission.precheck(self._admit_request(tenant, state, state.cost))
                return await self._enqueue(tenant, state, rctx)
            raise

    async def _tokenize(self, tenant: Tenant, state: RequestState, rctx: Context) -> None:
        inp = state.inp
        t = time.monotonic()
        with child_span(_tracer, "tokenize", context=rctx):
            if inp.token_ids is not None:
                state.prompt_ids = list(inp.token_ids)
            else:
                state.prompt_ids = await self.ports.tokenizer.tokenize(timeout=state.remaining(),
                                                                       **_prompt(tenant, inp))
        self._tokenize_done(state, t)

    def _tokenize_now(self, tenant: Tenant, state: RequestState) -> bool:
        """Tokenize the prompt without a loop turn when the tokenizer port can (`tokenize_now`: a
        short prompt this process encodes, its encoder idle); False when it cannot."""
        inp = state.inp
        now = getattr(self.ports.tokenizer, "tokenize_now", None)
        if now is None or inp.token_ids is not None:
            return False
        t = time.monotonic()
        ids = now(**_prompt(tenant, inp))
        if ids is None:
            return False
        state.prompt_ids = ids
        self._tokenize_done(state, t)
        return True

    def _tokenize_done(self, state: RequestState, t: float) -> None:
        state.t_tokenized = time.monotonic()
        state.timings.tokenize_seconds = state.t_tokenized - t
        if state.inp.token_ids is None:
            self.estimate.observe(state.inp, len(state.prompt_ids))
        state.check_deadline()

    async def _enqueue(self, tenant: Tenant, state: RequestState, rctx: Context, cost: int = 0) -> Admitting:
        """One round trip: granted at once, queued (with its position), or refused. `cost`: the
        request's estimated tokens when its prompt is not tokenized yet (else prompt + max_tokens)."""
        request = self._admit_request(tenant, state, cost or state.cost)
        try:
            with child_span(_tracer, "queue_wait", context=rctx):   # the enqueue round trip
                async with asyncio.timeout(state.remaining()):
                    return await self.ports.admission.admit(request)
        except TimeoutError:
            raise Reason.DEADLINE_EXCEEDED.error("the deadline passed while waiting for admission") from None

    def _admit_request(self, tenant: Tenant, state: RequestState, cost: int) -> AdmitRequest:
        limits = tenant_limits(tenant, self.options.default_max_queued)
        return AdmitRequest(tenant.name, state.request_id, state.priority, cost, state.remaining(), *limits)

    async def _queued(self, state: RequestState, admitting: Admitting, rctx: Context) -> AsyncIterator[Event]:
        """Wait in the queue: an `Accepted` with the new position at each change, until granted.
        A deadline, a Cancel (from any router) or the client going away takes it out at once."""
        QUEUED.labels(state.tenant).inc()
        self.ports.registry.on_cancel(state.tenant, state.request_id, admitting.cancel)
        try:
            # Not made current: this block yields (a client gone meanwhile leaves the generator
            # to be closed in another Context).
            with detached_span(_tracer, "queued", context=rctx):  # waiting for the grant
                async with asyncio.timeout(state.remaining()):
                    while admitting.grant is None:
                        await admitting.next()
                        if admitting.grant is None:
                            yield Accepted(state.request_id, len(state.prompt_ids), admitting.position)
        except TimeoutError:
            raise Reason.DEADLINE_EXCEEDED.error("the deadline passed while queued") from None
        finally:
            QUEUED.labels(state.tenant).dec()

    def _max_context(self) -> int:
        meta = self.ports.tokenizer.meta
        contexts = [c for c in (self.ports.engines.max_context, meta.max_context if meta else 0) if c]
        return min(contexts) if contexts else 0

    async def _run(self, state: RequestState, metrics: RequestMetrics, rctx: Context,
                   accepted: Accepted | None = None) -> AsyncIterator[Event]:
        """The engine stage and the deltas; `accepted`, when given, goes out once the stage has
        placed the request and its submit is written (`_SUBMIT_TURNS` at most)."""
        if state.is_cancelled:   # cancelled while tokenizing or waiting for admission
            if accepted is not None:
                yield accepted
            yield done_event(state, metrics, None)
            return
        meta = self.ports.tokenizer.meta
        eos = list(meta.eos_token_ids) if meta else []
        detok = self.ports.detokenize.detokenizer(state.upstream_id)
        # The engine first: the stage places and submits the request now when it can (`start`); the
        # loop then turns once, in which the engine stream's sender (woken by the submit) writes it,
        # and the detokenizer session starts after that (no token can come back sooner). Started
        # first, the session's start held the submit's post back by ~0.1 ms on quiet cores; started
        # in the same step after the post, it and the rest of this step held the write back by
        # 0.1-0.2 ms (docs/benchmarks.md, eleventh session).
        # From here on the engine may have the request: every way out aborts and releases it.
        started = self.stage.start(state, detok, eos, rctx)
        pump = started.task
        ending: Ending | None = None
        flushed = False
        try:
            if started.submitted:
                await asyncio.sleep(0)
            detok.start(state.inp.sampling.stop, state.inp.sampling.include_stop_str,
                        state.prompt_ids[-_DETOK_CONTEXT:], inject(rctx))
            ending = Ending(state, detok, self.ports.engines)
            self.ports.registry.on_cancel(state.tenant, state.request_id, ending.on_cancel)
            pump.add_done_callback(lambda _: stage_ended(state, detok))
            if accepted is not None:
                # The Accepted after the submit's write: written first, its send held the engine's
                # submit back by ~0.3 ms at idle. Submitted by `start`, the write went out in the turn
                # above; placed by the stage's task (`start` waited for a session lookup), it goes out
                # in one of the next turns.
                for _ in range(0 if started.submitted else _SUBMIT_TURNS):
                    await asyncio.sleep(0)
                yield accepted
            final: Merged | None = None
            reply = state.reply = [] if self._keeps_reply(state.inp) else None
            async for item in deltas(state, detok, metrics):
                if isinstance(item, (Delta, Migrated)):
                    if reply is not None and type(item) is Delta:
                        reply.append(item.text)
                    yield item
                else:
                    final = item
            flushed = not state.is_cancelled
            yield done_event(state, metrics, final)
        finally:
            if ending is not None:
                ending.close()
            await discard(pump)
            if state.replica:
                if not state.engine_done:
                    self.ports.engines.abort(state.replica, state.upstream_id)
                self.ports.engines.release(state.replica, state.upstream_id)
            detok.close(flushed=flushed)
