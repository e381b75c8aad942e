"""Wire the router: tenants, admission, upstreams, the Inference servicer and the server."""

from __future__ import annotations

import asyncio
import time

from services.errors import TokenrelayError
from services.grpc_util import GrpcServer, wait_for_shutdown_signal, write_port_file
from services.logging import get_logger
from services.metrics import start_metrics_server
from services.proto.tokenrelay.v1 import inference_pb2, inference_pb2_grpc
from services.tracing import ServerTracingInterceptor, configure_tracing

from .admission import Admission
from .config import RouterSettings
from .pipeline import Router
from .servicer import InferenceServicer
from .tenants import TenantsFileError
from .tenants_reload import TenantsReloader
from .upstreams import EnginePool, TokenizerUpstream

log = get_logger(__name__)
SERVICE_NAME = inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name


async def _wait_tokenizer(tokenizer: TokenizerUpstream, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            meta = await tokenizer.info()
            log.info("tokenizer_ready", name=meta.name, vocab=meta.vocab_size, max_context=meta.max_context)
            return
        except TokenrelayError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


async def serve(settings: RouterSettings) -> None:
    telemetry, upstreams = settings.telemetry, settings.upstreams
    configure_tracing("router_svc", telemetry.otlp_endpoint, trace_file=telemetry.trace_file)
    try:
        tenants = TenantsReloader(settings.tenants_file, settings.tenants_reload_interval)
    except TenantsFileError as exc:
        raise SystemExit(f"router_svc: {exc}") from None
    admission = Admission(settings.admission)
    tokenizer = TokenizerUpstream(upstreams.tokenizers, upstreams.upstream_timeout,
                                  max_calls=upstreams.tokenize_calls_in_flight,
                                  max_bytes=upstreams.tokenize_bytes_in_flight, security=settings.security)
    engines = EnginePool(upstreams.engines, settings.routing.engine_poll_interval, security=settings.security)
    try:
        await tenants.start()  # before the slow waits, so a SIGHUP during startup reloads, not kills
        await _wait_tokenizer(tokenizer, upstreams.startup_timeout)
        await engines.start()
        router = Router(tokenizer, engines, admission, settings.limits.request_timeout,
                        settings.routing.engine_attempts)
        server = GrpcServer(settings.server.host, settings.server.port, [SERVICE_NAME], [ServerTracingInterceptor()],
                            security=settings.security)
        inference_pb2_grpc.add_InferenceServicer_to_server(InferenceServicer(router, tenants), server.server)
        await server.start()
        metrics_port = start_metrics_server(settings.server.host, telemetry.metrics_port)
        write_port_file(telemetry.metrics_port_file, metrics_port)
        write_port_file(settings.server.port_file, server.port)
        log.info("listening", address=server.address, metrics_port=metrics_port,
                 tenants=len(tenants.registry.tenants), engines=upstreams.engines, tokenizers=upstreams.tokenizers)
        await wait_for_shutdown_signal()
        log.info("shutting_down", in_flight=router.in_flight)
        await server.stop(settings.server.shutdown_grace)
    finally:
        await tenants.close()
        await engines.close()
        await tokenizer.close()
        await admission.close()
