"""The one typed exception tree of tokenrelay and its mapping to and from gRPC status.

    TokenrelayError                  (INTERNAL unless a subclass says otherwise)
    ├── Unauthenticated              UNAUTHENTICATED     missing / unknown API key
    ├── PermissionDenied             PERMISSION_DENIED   model or priority not allowed
    ├── InvalidArgument              INVALID_ARGUMENT    bad parameters, prompt too long, ...
    ├── NotFound                     NOT_FOUND           unknown request / session id
    ├── ResourceExhausted            RESOURCE_EXHAUSTED  tenant limits (carries retry_after)
    ├── Unavailable                  UNAVAILABLE         overload, no replica, Redis down
    ├── DeadlineExceeded             DEADLINE_EXCEEDED
    ├── Cancelled                    CANCELLED
    └── Internal                     INTERNAL

Every error carries a machine-readable ``reason`` (UPPER_SNAKE). `Reason` below is the registry:
every reason of the mesh declared once, with its exception class (hence its gRPC status), whether
another replica may be tried before the first token (`retryable`), where it may travel (`Scope`),
a default retry-after and a description. Raise ``Reason.X.error("message")``: the status is data.
On the wire the status code is the gRPC code, the reason travels in the trailing metadata key
``tokenrelay-reason`` and a retry hint in ``tokenrelay-retry-after-ms``; on a multiplexed stream
a request's reason travels in-band (`in_band_error`). `from_rpc_error` rebuilds the typed
exception on the client side, so both directions are translated in this one module.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import ClassVar

import grpc

REASON_KEY = "tokenrelay-reason"
RETRY_AFTER_KEY = "tokenrelay-retry-after-ms"


class TokenrelayError(Exception):
    code: ClassVar[grpc.StatusCode] = grpc.StatusCode.INTERNAL
    default_reason: ClassVar[str] = "INTERNAL"

    def __init__(self, message: str, reason: str | None = None, *,
                 retry_after: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.reason: str = str(reason) if reason else self.default_reason   # a `Reason` or a peer's name
        self.retry_after = retry_after

    @property
    def retryable(self) -> bool:
        """May another replica be tried (before the first token)? Data in the registry."""
        known = Reason.lookup(self.reason)
        return known is not None and known.retryable

    def __str__(self) -> str:
        return f"{self.reason}: {self.message}"

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        md: list[tuple[str, str]] = [(REASON_KEY, self.reason)]
        if self.retry_after is not None:
            md.append((RETRY_AFTER_KEY, str(max(0, int(self.retry_after * 1000)))))
        return tuple(md)


class Unauthenticated(TokenrelayError):
    code = grpc.StatusCode.UNAUTHENTICATED
    default_reason = "UNAUTHENTICATED"


class PermissionDenied(TokenrelayError):
    code = grpc.StatusCode.PERMISSION_DENIED
    default_reason = "PERMISSION_DENIED"


class InvalidArgument(TokenrelayError):
    code = grpc.StatusCode.INVALID_ARGUMENT
    default_reason = "INVALID_ARGUMENT"


class NotFound(TokenrelayError):
    code = grpc.StatusCode.NOT_FOUND
    default_reason = "NOT_FOUND"


class ResourceExhausted(TokenrelayError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    default_reason = "RESOURCE_EXHAUSTED"


class Unavailable(TokenrelayError):
    code = grpc.StatusCode.UNAVAILABLE
    default_reason = "UNAVAILABLE"


class DeadlineExceeded(TokenrelayError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED
    default_reason = "DEADLINE_EXCEEDED"


class Cancelled(TokenrelayError):
    code = grpc.StatusCode.CANCELLED
    default_reason = "CANCELLED"


class Internal(TokenrelayError):
    code = grpc.StatusCode.INTERNAL
    default_reason = "INTERNAL"


_BY_CODE: dict[grpc.StatusCode, type[TokenrelayError]] = {
    cls.code: cls for cls in (Unauthenticated, PermissionDenied, InvalidArgument, NotFound,
                              ResourceExhausted, Unavailable, DeadlineExceeded, Cancelled, Internal)
}


class Scope(StrEnum):
    """Where a reason may travel."""

    CLIENT = "client"   # the router may send it to its clients (the README's "## Errors" table)
    STATUS = "status"   # no reason was given: a class's default, or a status raised by gRPC itself
    #                     (DEADLINE_EXCEEDED, CANCELLED and INTERNAL are CLIENT: clients see them)
    MESH = "mesh"       # between services only: the router maps it before a client could see it
    LOCAL = "local"     # raised and kept in one process (client library, tooling); never on the wire


@dataclass(frozen=True)
class _Spec:
    error_class: type[TokenrelayError]
    description: str
    scope: Scope
    retryable: bool
    retry_after: float | None


def _client(error_class: type[TokenrelayError], description: str, *, retryable: bool = False,
            retry_after: float | None = None, scope: Scope = Scope.CLIENT) -> _Spec:
    return _Spec(error_class, description, scope, retryable, retry_after)


def _status(error_class: type[TokenrelayError], description: str, *, retryable: bool = False) -> _Spec:
    return _Spec(error_class, description, Scope.STATUS, retryable, None)


def _mesh(error_class: type[TokenrelayError], description: str) -> _Spec:
    return _Spec(error_class, description, Scope.MESH, False, None)


def _local(error_class: type[TokenrelayError], description: str) -> _Spec:
    return _Spec(error_class, description, Scope.LOCAL, False, None)


class Reason(StrEnum):
    """The error registry: every reason of tokenrelay, declared once (member name == value).

    ``retryable``: another replica may be tried before the first token (the stream broke, an
    in-band overload, a draining replica, an upstream that cannot be reached). ``retry_after``:
    the hint a client gets when the raising site gives none (in-band errors carry none).
    """

    error_class: type[TokenrelayError]
    description: str
    scope: Scope
    retryable: bool
    retry_after: float | None

    def __new__(cls, value: str, spec: _Spec) -> Reason:
        member = str.__new__(cls, value)
        member._value_ = value
        member.error_class = spec.error_class
        member.description = spec.description
        member.scope = spec.scope
        member.retryable = spec.retryable
        member.retry_after = spec.retry_after
        return member

    # -- authentication and permissions
    MISSING_API_KEY = "MISSING_API_KEY", _client(Unauthenticated, "no API key in the call's metadata")
    INVALID_API_KEY = "INVALID_API_KEY", _client(Unauthenticated, "the API key matches no tenant")
    BAD_AUTHORIZATION = "BAD_AUTHORIZATION", _client(InvalidArgument, "`authorization` is not `Bearer <key>`")
    MODEL_NOT_ALLOWED = "MODEL_NOT_ALLOWED", _client(PermissionDenied, "the tenant may not use this model")
    PRIORITY_NOT_ALLOWED = "PRIORITY_NOT_ALLOWED", _client(PermissionDenied,
                                                           "priority above the tenant's ceiling")
    # -- the request itself
    MISSING_INPUT = "MISSING_INPUT", _client(InvalidArgument, "not exactly one of prompt, messages, token_ids")
    EMPTY_PROMPT = "EMPTY_PROMPT", _client(InvalidArgument, "empty prompt, messages or token ids, or a "
                                           "prompt that tokenizes to nothing")
    PROMPT_TOO_LONG = "PROMPT_TOO_LONG", _client(InvalidArgument, "prompt over the tenant's, the "
                                                 "tokenizer's or the model's limit")
    CONTEXT_LENGTH_EXCEEDED = "CONTEXT_LENGTH_EXCEEDED", _client(InvalidArgument,
                                                                 "prompt + max_tokens over the model context")
    MAX_TOKENS_TOO_LARGE = "MAX_TOKENS_TOO_LARGE", _client(InvalidArgument, "max_tokens above the tenant's cap")
    INVALID_MAX_TOKENS = "INVALID_MAX_TOKENS", _client(InvalidArgument, "max_tokens below 1")
    INVALID_TEMPERATURE = "INVALID_TEMPERATURE", _client(InvalidArgument, "temperature outside [0, 100]")
    INVALID_TOP_P = "INVALID_TOP_P", _client(InvalidArgument, "top_p outside [0, 1]")
    INVALID_SAMPLING = "INVALID_SAMPLING", _client(InvalidArgument, "sampling parameters the engine refuses")
    UNSUPPORTED_SAMPLING = "UNSUPPORTED_SAMPLING", _client(InvalidArgument,
                                                           "sampling the engine backend cannot do")
    INVALID_STOP = "INVALID_STOP", _client(InvalidArgument, "a stop string empty or too long")
    TOO_MANY_STOP_STRINGS = "TOO_MANY_STOP_STRINGS", _client(InvalidArgument, "more stop strings than allowed")
    INVALID_TOKEN_ID = "INVALID_TOKEN_ID", _client(InvalidArgument, "a token id beyond the vocabulary")
    INVALID_REQUEST_ID = "INVALID_REQUEST_ID", _client(InvalidArgument, "request id too long")
    DUPLICATE_REQUEST_ID = "DUPLICATE_REQUEST_ID", _client(InvalidArgument, "request id already in flight")
    MISSING_REQUEST_ID = "MISSING_REQUEST_ID", _client(InvalidArgument, "a request on a Stream call without "
                                                       "its request id")
    INPUT_TOO_LARGE = "INPUT_TOO_LARGE", _client(InvalidArgument, "an input over the tokenizer's byte limit")
    NO_CHAT_TEMPLATE = "NO_CHAT_TEMPLATE", _client(InvalidArgument, "messages, but the model has no chat template")
    CHAT_TEMPLATE_ERROR = "CHAT_TEMPLATE_ERROR", _client(InvalidArgument,
                                                         "the chat template failed on these messages")
    CHAT_NOT_STARTED = "CHAT_NOT_STARTED", _client(InvalidArgument, "a chat stream's first message is not `start`")
    CHAT_ALREADY_STARTED = "CHAT_ALREADY_STARTED", _client(InvalidArgument, "`start` sent twice on a chat stream")
    TURN_IN_PROGRESS = "TURN_IN_PROGRESS", _client(InvalidArgument, "a chat turn while one is running")
    INVALID_SESSION_ID = "INVALID_SESSION_ID", _client(InvalidArgument, "session id too long")
    INVALID_MODEL = "INVALID_MODEL", _client(InvalidArgument, "model name too long")
    TOO_MANY_MESSAGES = "TOO_MANY_MESSAGES", _client(InvalidArgument, "more chat messages than allowed, or a "
                                                     "role / content over its length bound")
    INVALID_DELTA_OPTIONS = "INVALID_DELTA_OPTIONS", _client(InvalidArgument, "min_delta_tokens or "
                                                             "min_delta_interval_ms out of range")
    MALFORMED_MESSAGE = "MALFORMED_MESSAGE", _client(InvalidArgument, "a message that does not decode "
                                                     "(bad protobuf, invalid UTF-8 in a string)")
    UNKNOWN_SESSION = "UNKNOWN_SESSION", _client(NotFound, "a session id of another tenant")
    # -- limits, overload and availability
    TENANT_CONCURRENCY_LIMIT = "TENANT_CONCURRENCY_LIMIT", _client(
        ResourceExhausted, "the tenant's cluster-wide concurrency limit", retry_after=1.0)
    # (issue 11: the admission queue)
    TENANT_QUEUE_FULL = "TENANT_QUEUE_FULL", _client(ResourceExhausted, "the tenant's max_queued requests are "
                                                     "already waiting for admission", retry_after=1.0)
    CLASS_QUEUE_FULL = "CLASS_QUEUE_FULL", _client(ResourceExhausted, "the priority class's queue is full, "
                                                   "pool-wide", retry_after=1.0)
    TOKEN_RATE_LIMITED = "TOKEN_RATE_LIMITED", _client(ResourceExhausted, "the tenant's tokens_per_minute would "
                                                       "not allow this request before its deadline")
    TOKEN_BUDGET_TOO_SMALL = "TOKEN_BUDGET_TOO_SMALL", _client(ResourceExhausted, "prompt + max_tokens exceeds "
                                                               "the tenant's whole tokens_per_minute")
    QUEUE_WAIT_EXCEEDS_DEADLINE = "QUEUE_WAIT_EXCEEDS_DEADLINE", _client(
        ResourceExhausted, "the estimated queue wait is beyond the request's deadline (or --max-queue-wait)")
    STREAM_FULL = "STREAM_FULL", _client(ResourceExhausted, "a Stream call already has its most requests in "
                                         "flight (--max-stream-requests)", retry_after=0.1)
    QUEUE_ENTRY_LOST = "QUEUE_ENTRY_LOST", _client(Unavailable, "the request's queue entry expired (its router "
                                                   "missed its keep-alives)", retry_after=0.1)
    ADMISSION_STORE_FULL = "ADMISSION_STORE_FULL", _client(Unavailable, "the admission store (Redis) is at "
                                                           "maxmemory (fail-closed)", retry_after=1.0)
    OVERLOADED = "OVERLOADED", _client(Unavailable, "a tokenizer or engine replica is over its queue limit",
                                       retryable=True, retry_after=1.0)
    SHUTTING_DOWN = "SHUTTING_DOWN", _client(Unavailable, "the replica is draining or shutting down",
                                             retryable=True, retry_after=0.1)
    ENGINE_UNAVAILABLE = "ENGINE_UNAVAILABLE", _client(Unavailable, "the engine backend is stopped or failed",
                                                       retryable=True, retry_after=1.0)
    ENGINE_STALLED = "ENGINE_STALLED", _client(Unavailable, "an engine replica sent nothing for longer than "
                                               "--engine-progress-timeout", retryable=True, retry_after=1.0)
    UPSTREAM_UNAVAILABLE = "UPSTREAM_UNAVAILABLE", _client(Unavailable, "an upstream service cannot be "
                                                           "reached, or its stream broke", retryable=True)
    NO_HEALTHY_REPLICA = "NO_HEALTHY_REPLICA", _client(Unavailable, "no healthy engine replica is left",
                                                       retry_after=1.0)
    REDIS_UNAVAILABLE = "REDIS_UNAVAILABLE", _client(Unavailable, "the admission store is unreachable "
                                                     "(fail-closed)", retry_after=1.0)
    CANCEL_NOT_CONFIRMED = "CANCEL_NOT_CONFIRMED", _client(Unavailable, "the router process holding the request "
                                                           "did not confirm the Cancel in time (it may still "
                                                           "run): send the Cancel again", retry_after=0.5)
    ROUTER_OVERLOADED = "ROUTER_OVERLOADED", _client(Unavailable, "this router process is over its "
                                                     "in-flight or event-loop-lag bound (another router may "
                                                     "serve it)", retryable=True, retry_after=0.1)
    TOKENIZE_TIMEOUT = "TOKENIZE_TIMEOUT", _client(DeadlineExceeded, "tokenization did not finish in time")
    # -- failures of the mesh
    ENGINE_ERROR = "ENGINE_ERROR", _client(Internal, "the engine failed the request")
    DETOKENIZER_ERROR = "DETOKENIZER_ERROR", _client(Internal, "the detokenizer failed the request")
    TOKENIZER_ERROR = "TOKENIZER_ERROR", _client(Internal, "the tokenize call failed unexpectedly")
    # -- between services only
    BATCH_TOO_LARGE = "BATCH_TOO_LARGE", _mesh(InvalidArgument, "more inputs in one Tokenize call than "
                                               "--max-batch (the router splits the call)")
    CACHE_KEY_TOO_LONG = "CACHE_KEY_TOO_LONG", _mesh(InvalidArgument, "a chat cache_key over the tokenizer's "
                                                     "--max-cache-key-bytes (the router's keys are shorter)")
    UNKNOWN_REQUEST = "UNKNOWN_REQUEST", _mesh(Internal, "detokenizer tokens for a request that is not open")
    # -- no reason given: the status's own name
    UNAUTHENTICATED = "UNAUTHENTICATED", _status(Unauthenticated, "unauthenticated")
    PERMISSION_DENIED = "PERMISSION_DENIED", _status(PermissionDenied, "permission denied")
    INVALID_ARGUMENT = "INVALID_ARGUMENT", _status(InvalidArgument, "invalid argument")
    NOT_FOUND = "NOT_FOUND", _status(NotFound, "not found")
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED", _status(ResourceExhausted, "resource exhausted (e.g. a "
                                                       "message over gRPC's size limit)")
    UNAVAILABLE = "UNAVAILABLE", _status(Unavailable, "unavailable", retryable=True)
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED", _client(DeadlineExceeded, "the call's deadline passed")
    CANCELLED = "CANCELLED", _client(Cancelled, "the call was cancelled")
    INTERNAL = "INTERNAL", _client(Internal, "an unexpected error (logged by the service)")
    UNKNOWN = "UNKNOWN", _status(Internal, "a failure without a status")
    # -- in one process only
    INCOMPLETE_STREAM = "INCOMPLETE_STREAM", _local(Internal, "a Generate stream ended without `done`")
    STREAM_CLOSED = "STREAM_CLOSED", _local(Internal, "the chat stream closed")
    CLIENT_CANCELLED = "CLIENT_CANCELLED", _local(Cancelled, "the client went away (router metrics)")
    BENCH_TIMEOUT = "BENCH_TIMEOUT", _local(DeadlineExceeded, "the load generator's per-request timeout")
    BENCH_DRAIN_TIMEOUT = "BENCH_DRAIN_TIMEOUT", _local(Cancelled, "cut off when the load generator's "
                                                        "drain time ran out")

    @property
    def code(self) -> grpc.StatusCode:
        return self.error_class.code

    def error(self, message: str = "", *, retry_after: float | None = None) -> TokenrelayError:
        """The typed error of this reason; its class (and so its status) comes from the registry."""
        return self.error_class(message or self.description, self,
                                retry_after=self.retry_after if retry_after is None else retry_after)

    @classmethod
    def lookup(cls, name: str) -> Reason | None:
        """The registered reason of a name, an older peer's synonym included; None if unknown."""
        name = _RENAMED.get(name, name)
        return cls._value2member_map_.get(name)  # type: ignore[return-value]


# Names older peers send, merged into one registered name each.
_RENAMED: dict[str, str] = {
    "ENGINE_OVERLOADED": Reason.OVERLOADED,      # the engine's own name for OVERLOADED
    "TOO_MANY_REQUESTS": Reason.OVERLOADED,      # the detokenizer's stream limit
    "EMPTY_INPUT": Reason.EMPTY_PROMPT,          # the tokenizer's name for it
    "DUPLICATE_REQUEST": Reason.DUPLICATE_REQUEST_ID,   # the detokenizer's name for it
}


def error_for(reason: str, message: str, *, code: grpc.StatusCode | None = None,
              retry_after: float | None = None) -> TokenrelayError:
    """The typed error of a reason from the wire. A registered reason (or an older peer's synonym)
    picks its class from the registry; an unknown one (a newer peer's) keeps its name and takes
    the class of `code` (INTERNAL without one)."""
    known = Reason.lookup(reason)
    if known is not None:
        return known.error(message, retry_after=retry_after)
    cls = _BY_CODE.get(code, Internal) if code is not None else Internal
    return cls(message or reason, reason, retry_after=retry_after)


def in_band_error(reason: str, message: str, peer_failure: Reason) -> TokenrelayError:
    """The typed error of a request that a multiplexed stream (engine `error_reason`, detokenizer
    `error`) failed in-band. The peer's own failures (an INTERNAL-class or mesh-only reason, or
    none) become `peer_failure`, which names the peer; the rest come from the registry."""
    known = Reason.lookup(reason)
    if not reason or known is peer_failure:
        return peer_failure.error(message)
    if known is not None and (known.scope is Scope.MESH or known.error_class is Internal):
        return peer_failure.error(f"{reason}: {message}")
    return error_for(reason, message, code=peer_failure.code)


def from_rpc_error(err: grpc.RpcError) -> TokenrelayError:
    """Rebuild the typed error from a failed call (client side)."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = (err.details() if hasattr(err, "details") else None) or str(code)
    md = dict(err.trailing_metadata() or ()) if hasattr(err, "trailing_metadata") else {}
    reason = md.get(REASON_KEY)
    retry_ms = md.get(RETRY_AFTER_KEY)
    if reason is None:
        # Errors raised by gRPC itself (no tokenrelay reason) keep their status name; UNAVAILABLE
        # without a reason is a connection that failed.
        if code == grpc.StatusCode.UNAVAILABLE:
            reason = Reason.UPSTREAM_UNAVAILABLE
        else:
            reason = code.name if code is not None else Reason.UNKNOWN
    error = error_for(reason, details, code=code, retry_after=int(retry_ms) / 1000 if retry_ms else None)
    error.__cause__ = err
    return error
