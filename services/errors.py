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

Every error carries a machine-readable ``reason`` (UPPER_SNAKE). On the wire the status code
is the gRPC code, the reason travels in the trailing metadata key ``tokenrelay-reason`` and a
retry hint in ``tokenrelay-retry-after-ms``. `from_rpc_error` rebuilds the typed exception on
the client side, so both directions are translated in this one module.
"""

from __future__ import annotations

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
        self.reason = reason or self.default_reason
        self.retry_after = retry_after

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


def from_rpc_error(err: grpc.RpcError) -> TokenrelayError:
    """Rebuild the typed error from a failed call (client side)."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = (err.details() if hasattr(err, "details") else None) or str(code)
    md = dict(err.trailing_metadata() or ()) if hasattr(err, "trailing_metadata") else {}
    reason = md.get(REASON_KEY)
    retry_ms = md.get(RETRY_AFTER_KEY)
    cls = _BY_CODE.get(code, Internal)
    if reason is None:
        reason = code.name if code is not None else "UNKNOWN"
        # Errors raised by gRPC itself (no tokenrelay reason) keep their status name.
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                    grpc.StatusCode.CANCELLED):
            reason = {"UNAVAILABLE": "UPSTREAM_UNAVAILABLE"}.get(code.name, code.name)
    error = cls(details, reason, retry_after=int(retry_ms) / 1000 if retry_ms else None)
    error.__cause__ = err
    return error
