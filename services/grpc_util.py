"""gRPC plumbing shared by every service: the server lifecycle and the error boundary.

`ErrorInterceptor` is the one place where a `TokenrelayError` raised by domain code becomes a
gRPC status (code, details, reason in trailing metadata); a generated servicer's unimplemented
method (NotImplementedError) becomes UNIMPLEMENTED; anything else becomes INTERNAL with reason
``INTERNAL`` and is logged. Servicers therefore contain no try/except.

It also owns decoding: every method's request deserializer is wrapped so that it never raises (gRPC
would answer UNKNOWN before any project code ran, or hand the exception to the handler mid-stream);
bytes that do not decode become INVALID_ARGUMENT / MALFORMED_MESSAGE, for a unary request before
the handler runs, inside a client stream where the handler reads that message.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

import grpc
from grpc._cython import cygrpc as _cygrpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.channels import bind_port, open_channel, server_options
from services.errors import REASON_KEY, Reason, TokenrelayError
from services.logging import get_logger
from services.security import PLAINTEXT, SecuritySettings

log = get_logger(__name__)
# What `context.abort` raises when the status cannot be sent because the call has ended in core:
# `ExecuteBatchError`, not exported by grpc.aio (a subclass of its public `InternalError`).
_CORE_BATCH_FAILED: type[Exception] = getattr(_cygrpc, "ExecuteBatchError", grpc.aio.InternalError)


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException, method: str) -> None:
    try:
        if isinstance(exc, TokenrelayError):
            context.set_trailing_metadata(exc.trailing_metadata())
            await context.abort(exc.code, exc.message)
        if isinstance(exc, NotImplementedError):
            # A generated servicer's method that nobody implemented (the standard health service's List).
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{method} is not implemented")
        log.exception("unhandled_error", method=method, exc_info=exc)
        context.set_trailing_metadata(((REASON_KEY, str(Reason.INTERNAL)),))
        await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}")
    except grpc.aio.AbortError:
        raise
    except _CORE_BATCH_FAILED:
        # The call had already ended in gRPC's core (its deadline fired there, or its client went
        # away) before the handler's own error could be sent: nobody can receive a status any
        # more. grpc would log that as an ERROR with a traceback unless it has already seen the
        # call close, which races the handler at a deadline (bench/probe_mix.py found it); the
        # handler ends as cancelled instead, which grpc logs at debug level.
        log.info("status_not_sent", method=method, error=type(exc).__name__,
                 reason=str(exc.reason) if isinstance(exc, TokenrelayError) else "")
        raise asyncio.CancelledError from None


class Undecodable:
    """What a wrapped request deserializer returns for bytes that do not decode."""

    __slots__ = ("detail",)

    def __init__(self, detail: str) -> None:
        self.detail = detail

    def error(self, method: str) -> TokenrelayError:
        return Reason.MALFORMED_MESSAGE.error(f"a {method} request does not decode: {self.detail}")


def tolerant_deserializer(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    """``deserialize`` that returns an `Undecodable` instead of raising (None: raw bytes stay raw)."""
    if deserialize is None:
        return None

    def tolerant(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as exc:  # noqa: BLE001 - DecodeError, or whatever a custom deserializer raises
            return Undecodable(f"{type(exc).__name__}: {exc}")
    return tolerant


def _decoded(request: Any, method: str) -> Any:
    if isinstance(request, Undecodable):
        raise request.error(method)
    return request


async def _decoded_stream(requests: AsyncIterator[Any], method: str) -> AsyncIterator[Any]:
    async for request in requests:
        yield _decoded(request, method)


def _wrap_unary(fn: Callable[..., Awaitable[Any]], method: str, stream_in: bool) -> Callable[..., Awaitable[Any]]:
    async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            request = _decoded_stream(request, method) if stream_in else _decoded(request, method)
            return await fn(request, context)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:  # noqa: BLE001 - the error boundary
            await _abort(context, exc, method)
    return wrapper


def _wrap_stream(fn: Callable[..., Any], method: str, stream_in: bool) -> Callable[..., Any]:
    if not inspect.isasyncgenfunction(fn):
        # A handler that writes with `context.write` and returns None (the standard health
        # service's Watch): grpc tells the two styles apart by the function, so this wrapper
        # must be a coroutine function too.
        return _wrap_unary(fn, method, stream_in)

    async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            request = _decoded_stream(request, method) if stream_in else _decoded(request, method)
            async for item in fn(request, context):
                yield item
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:  # noqa: BLE001 - the error boundary
            await _abort(context, exc, method)
    return wrapper


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation: Callable[..., Awaitable[Any]],
                                handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        decode = tolerant_deserializer(handler.request_deserializer)
        if handler.unary_unary:
            return handler._replace(unary_unary=_wrap_unary(handler.unary_unary, method, False),
                                    request_deserializer=decode)
        if handler.stream_unary:
            return handler._replace(stream_unary=_wrap_unary(handler.stream_unary, method, True),
                                    request_deserializer=decode)
        if handler.unary_stream:
            return handler._replace(unary_stream=_wrap_stream(handler.unary_stream, method, False),
                                    request_deserializer=decode)
        if handler.stream_stream:
            return handler._replace(stream_stream=_wrap_stream(handler.stream_stream, method, True),
                                    request_deserializer=decode)
        return handler


class GrpcServer:
    """A grpc.aio server with health + reflection, bound to host:port (0 = ephemeral) and secured as
    `security` says (`services.channels.bind_port`). ``reuse_port``: other processes that ask for it
    too may bind the same host:port (SO_REUSEPORT; several routers behind one address).

    Lifecycle: `start()` binds and marks SERVING; `stop(grace)` marks NOT_SERVING first so load
    balancers drain, then lets in-flight calls finish for `grace` seconds.
    """

    def __init__(self, host: str, port: int, service_names: Iterable[str],
                 interceptors: Iterable[grpc.aio.ServerInterceptor] = (), *,
                 security: SecuritySettings = PLAINTEXT, reuse_port: bool = False) -> None:
        self.server = grpc.aio.server(interceptors=[ErrorInterceptor(), *interceptors],
                                      options=server_options(reuse_port=reuse_port))
        self.health = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self._names = list(service_names)
        reflection.enable_server_reflection(
            [*self._names, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server)
        self.host = host
        self.port = bind_port(self.server, f"{host}:{port}", security)
        # Other listeners of the process that drain with it (the engine's frame port): each is
        # called with the grace period and runs beside the gRPC server's own stop.
        self._companions: list[Callable[[float], Awaitable[None]]] = []

    def on_stop(self, stop: Callable[[float], Awaitable[None]]) -> None:
        self._companions.append(stop)

    @property
    def address(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"{host}:{self.port}"

    async def _set_all(self, status: int) -> None:
        for name in ["", *self._names]:
            result = self.health.set(name, status)
            if asyncio.iscoroutine(result):
                await result

    async def start(self) -> None:
        await self.server.start()
        await self._set_all(health_pb2.HealthCheckResponse.SERVING)

    async def stop(self, grace: float) -> None:
        await self._set_all(health_pb2.HealthCheckResponse.NOT_SERVING)
        await asyncio.gather(self.server.stop(grace), *(stop(grace) for stop in self._companions))


async def wait_for_shutdown_signal() -> None:
    """Block until SIGTERM or SIGINT."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    await stop.wait()


async def wait_healthy(address: str, timeout: float, service: str = "", *,
                       security: SecuritySettings = PLAINTEXT) -> None:
    """Poll the standard health service until SERVING (used by the launcher and tests)."""
    deadline = asyncio.get_running_loop().time() + timeout
    async with open_channel(address, security) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                resp = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1.0)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"{address} not healthy after {timeout}s")
            await asyncio.sleep(0.05)


def write_port_file(path: str, port: int) -> None:
    """Atomically publish the bound port (launchers and tests start services on port 0)."""
    if not path:
        return
    import os

    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(str(port))
    os.replace(tmp, path)
