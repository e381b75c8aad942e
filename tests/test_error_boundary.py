"""The error boundary (`services.grpc_util.ErrorInterceptor`) when the status cannot be sent.

bench/probe_mix.py found it: a Generate whose deadline passed in the router's pipeline at the
moment gRPC's core also ended the call. The handler's DEADLINE_EXCEEDED could no longer be sent
(`context.abort` raised core's ExecuteBatchError), and grpc logged "ExecuteBatchError raised in
core by servicer method" as an ERROR with a traceback, for a call nobody could receive a status
on any more. That is a race with core's own deadline, so the test drives the wrapper with a
context whose abort fails the way core's does; the handler must end as cancelled (grpc logs that
at debug level) and nothing be logged as an error."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc
import pytest
from grpc._cython import cygrpc

import services.grpc_util
from services.errors import Reason
from services.grpc_util import _wrap_stream, _wrap_unary


class Recorder:
    """Stands in for the module's structlog logger: (level, event) of each call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def __getattr__(self, level: str) -> Any:
        return lambda event, **kw: self.calls.append((level, event))


@pytest.fixture
def logged(monkeypatch) -> Recorder:
    rec = Recorder()
    monkeypatch.setattr(services.grpc_util, "log", rec)
    return rec


class EndedInCore:
    """A servicer context of a call that core has already ended."""

    def __init__(self) -> None:
        self.aborts: list[Any] = []

    def set_trailing_metadata(self, md: Any) -> None:
        pass

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.aborts.append(code)
        raise cygrpc.ExecuteBatchError('Failed "execute_batch": (SendStatusFromServerOperation,)')


async def _stream_fails(request: Any, context: Any):   # type: ignore[no-untyped-def]
    yield "accepted"
    raise Reason.DEADLINE_EXCEEDED.error("the request's deadline passed")


async def _unary_fails(request: Any, context: Any) -> Any:
    raise Reason.DEADLINE_EXCEEDED.error("the request's deadline passed")


async def _unexpected(request: Any, context: Any) -> Any:
    raise KeyError("bug")


async def test_a_status_core_cannot_send_any_more_ends_the_handler_as_cancelled(caplog, logged) -> None:
    ctx = EndedInCore()
    handler = _wrap_stream(_stream_fails, "/tokenrelay.v1.Inference/Generate", False)
    got = []
    with pytest.raises(asyncio.CancelledError):
        async for item in handler(object(), ctx):
            got.append(item)
    assert got == ["accepted"] and ctx.aborts == [grpc.StatusCode.DEADLINE_EXCEEDED]
    with pytest.raises(asyncio.CancelledError):
        await _wrap_unary(_unary_fails, "/tokenrelay.v1.Inference/Cancel", False)(object(), EndedInCore())
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    assert logged.calls == [("info", "status_not_sent")] * 2


async def test_an_unexpected_error_is_still_logged_when_its_status_cannot_be_sent(logged) -> None:
    ctx = EndedInCore()
    with pytest.raises(asyncio.CancelledError):
        await _wrap_unary(_unexpected, "/tokenrelay.v1.Inference/Cancel", False)(object(), ctx)
    assert ctx.aborts == [grpc.StatusCode.INTERNAL]
    # The bug itself is not hidden by the lost status.
    assert logged.calls == [("exception", "unhandled_error"), ("info", "status_not_sent")]
