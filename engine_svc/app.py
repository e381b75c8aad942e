"""Wire the engine service: backend → Engine → servicer → GrpcServer, metrics and tracing, and shut
down gracefully."""

from __future__ import annotations

import asyncio

from grpc_health.v1 import health_pb2

from services import gcstats
from services.frames import FrameServer
from services.grpc_util import GrpcServer, wait_for_shutdown_signal, write_port_file
from services.logging import get_logger
from services.metrics import start_metrics_server
from services.proto.tokenrelay.v1 import engine_pb2, engine_pb2_grpc
from services.tracing import ServerTracingInterceptor, configure_tracing

from .backends import create_backend
from .backends.events import HealthState
from .config import EngineSettings
from .engine import Engine
from .registration import Registration, advertise_address, engine_report
from .servicer import EngineServicer, serve_frames

log = get_logger(__name__)
SERVICE_NAME = engine_pb2.DESCRIPTOR.services_by_name["Engine"].full_name


async def start_engine(settings: EngineSettings) -> tuple[Engine, GrpcServer]:
    """Build and start the engine and its server (tests use this in-process)."""
    engine = Engine(create_backend(settings), settings.max_queued)
    await engine.start()
    server = GrpcServer(settings.server.host, settings.server.port, [SERVICE_NAME], [ServerTracingInterceptor()],
                        security=settings.security)
    servicer = EngineServicer(engine)
    engine_pb2_grpc.add_EngineServicer_to_server(servicer, server.server)
    if settings.frame_port >= 0:
        frames = FrameServer(settings.server.host, settings.frame_port, lambda s: serve_frames(engine, s),
                             name="engine")
        servicer.frame_port = await frames.start()
        log.info("frame_port", host=settings.server.host, port=servicer.frame_port)
        server.on_stop(frames.stop)
    await server.start()
    _report_death(engine, server)
    return engine, server


def _report_death(engine: Engine, server: GrpcServer) -> None:
    """A dead or unavailable backend makes the standard health service answer NOT_SERVING (load
    balancers and the launcher stop sending work; the process stays up so its logs and metrics can
    be read); an unavailable one that serves again makes it answer SERVING again. A drain is the
    server's own business (`GrpcServer.stop` marks NOT_SERVING)."""
    pending: set[asyncio.Task[None]] = set()
    told = [health_pb2.HealthCheckResponse.SERVING]   # what the server's start() set

    async def tell(status: int) -> None:
        for name in ("", SERVICE_NAME):
            result = server.health.set(name, status)
            if asyncio.iscoroutine(result):
                await result

    def on_change() -> None:
        health = engine.health
        if health is HealthState.DRAINING:
            return
        status = (health_pb2.HealthCheckResponse.SERVING if health is HealthState.SERVING
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        if status == told[0]:
            return
        told[0] = status
        task = asyncio.get_running_loop().create_task(tell(status), name="engine-health-status")
        pending.add(task)
        task.add_done_callback(pending.discard)

    engine.on_health_change(on_change)
    on_change()   # it may have died while the server started


def start_metrics(settings: EngineSettings) -> int:
    """Serve /metrics on ``settings.telemetry.metrics_port`` and publish the bound port to
    ``metrics_port_file``; returns it (-1 = off). The endpoint lives as long as the process."""
    port = start_metrics_server(settings.server.host, settings.telemetry.metrics_port)
    write_port_file(settings.telemetry.metrics_port_file, port)
    return port


async def serve(settings: EngineSettings) -> None:
    configure_tracing("engine_svc", settings.telemetry.otlp_endpoint, trace_file=settings.telemetry.trace_file)
    try:
        # Metrics first: their failure then needs no cleanup, and /metrics already answers while
        # a large model loads.
        metrics_port = start_metrics(settings)
        engine, server = await start_engine(settings)
    except (ValueError, OSError) as exc:  # bad settings, missing model, port taken: say so, no traceback
        raise SystemExit(f"engine_svc: cannot start: {exc}") from exc
    registration: Registration | None = None
    try:
        frozen = gcstats.settle()   # startup's objects (the model's included) out of the collector's way
        write_port_file(settings.server.port_file, server.port)
        registration = await register(settings, engine, server)
        load = engine.load()
        log.info("listening", address=server.address, metrics_port=metrics_port, gc_frozen=frozen,
                 backend=load.backend,
                 model=load.model, max_context=load.max_context, max_active=load.max_active)
        await wait_for_shutdown_signal()
        log.info("shutting_down", live=engine.live)
        # Refuse new work, mark NOT_SERVING, and give in-flight requests the grace period; each
        # stream ends by itself once its requests are done, so an idle engine stops at once.
        engine.drain()
        await server.stop(settings.server.shutdown_grace)
    finally:
        if registration is not None:
            await registration.close()   # after the drain: routers retire it once it is gone
        await engine.close()
    log.info("stopped")


async def register(settings: EngineSettings, engine: Engine, server: GrpcServer) -> Registration | None:
    """Enter the engine in the routers' registry (--registry-redis-url); None when not configured."""
    reg = settings.registry
    if not reg.redis_url:
        return None
    address = advertise_address(reg.advertise_address, settings.server.host, server.port)
    registration = Registration(reg.redis_url, reg.pool, address,
                                lambda: engine_report(engine, address, reg.engine_pool),
                                heartbeat=reg.heartbeat, ttl=reg.ttl)
    engine.on_health_change(registration.wake)   # a drain reaches the routers before the next beat
    await registration.start()
    return registration
