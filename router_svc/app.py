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

from .admission import Admission, AdmissionSettings
from .config import RouterSettings
from .pipeline import Router
from .servicer import InferenceServicer
from .tenants import TenantRegistry
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
    if not settings.tenants_file:
        raise SystemExit("router_svc: --tenants-file is required")
    configure_tracing("router_svc", settings.otlp_endpoint)
    tenants = TenantRegistry.from_file(settings.tenants_file)
    admission = Admission(AdmissionSettings(settings.redis_url, settings.pool, settings.lease_ttl,
                                            settings.lease_ttl / 3, settings.fail_open))
    tokenizer = TokenizerUpstream(settings.tokenizers, settings.upstream_timeout,
                                  max_calls=settings.tokenize_calls_in_flight,
                                  max_bytes=settings.tokenize_bytes_in_flight)
    engines = EnginePool(settings.engines, settings.engine_poll_interval)
    try:
        await _wait_tokenizer(tokenizer, settings.startup_timeout)
        await engines.start()
        router = Router(tokenizer, engines, admission, settings.request_timeout, settings.engine_attempts)
        server = GrpcServer(settings.host, settings.port, [SERVICE_NAME], [ServerTracingInterceptor()])
        inference_pb2_grpc.add_InferenceServicer_to_server(InferenceServicer(router, tenants), server.server)
        await server.start()
        metrics_port = start_metrics_server(settings.host, settings.metrics_port)
        write_port_file(settings.metrics_port_file, metrics_port)
        write_port_file(settings.port_file, server.port)
        log.info("listening", address=server.address, metrics_port=metrics_port, tenants=len(tenants.tenants),
                 engines=settings.engines, tokenizers=settings.tokenizers)
        await wait_for_shutdown_signal()
        log.info("shutting_down", in_flight=router.in_flight)
        await server.stop(settings.shutdown_grace)
    finally:
        await engines.close()
        await tokenizer.close()
        await admission.close()
