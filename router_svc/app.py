"""Wire the router: tenants, admission, upstreams, the Inference servicer and the server."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from services import gcstats
from services.errors import TokenrelayError
from services.grpc_util import GrpcServer, wait_for_shutdown_signal, write_port_file
from services.logging import get_logger
from services.metrics import start_metrics_server
from services.proto.tokenrelay.v1 import inference_pb2
from services.tracing import ServerTracingInterceptor, configure_tracing

from .adapters import EnginesAdapter, build_router
from .admission import Admission
from .cluster import RedisCluster
from .config import RouterSettings, RoutingSettings, UpstreamSettings
from .discovery import TokenizerDiscovery, resolve_once
from .discovery import from_settings as discovery_from_settings
from .kv_events import KvEventFeeds
from .overload import AcceptProbe, IdleSpin, OverloadGate
from .placement import PrefixAware, PrefixWeights, make_policy
from .placement_share import PlacementShare
from .ports import Placement
from .prefix_index import PrefixIndex
from .servicer import InferenceServicer, add_to_server
from .shadow import PoolControl
from .tenants import TenantsFileError
from .tenants_reload import TenantsReloader
from .upstreams import TokenizerUpstream
from .validation import Bounds

if TYPE_CHECKING:
    from .local_detok import LocalDetokenize
    from .local_tokenize import LocalTokenize

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


async def _local_tokenizer(upstreams: UpstreamSettings, tokenizer: TokenizerUpstream,
                           ) -> tuple[LocalDetokenize | None, LocalTokenize | None]:
    """With --detokenize local and/or --tokenize-local-bytes: the tokenizer files loaded here once,
    refused unless they are the tokenizer service's (router_svc/local_detok.py, local_tokenize.py)."""
    if upstreams.detokenize != "local" and not upstreams.tokenize_local_bytes:
        return None, None
    from .local_detok import PROBE, LocalDetokenize, load_files, mismatch
    from .local_tokenize import LocalTokenize, template_of

    files = upstreams.tokenizer_files
    try:
        loaded = load_files(files)
        template = template_of(loaded, upstreams.tokenizer_chat_template)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"router_svc: --tokenizer-files {files}: {exc}") from None
    assert tokenizer.meta is not None    # _wait_tokenizer read it
    probe_ids = await tokenizer.tokenize(text=PROBE)
    why = mismatch(loaded, tokenizer.meta, probe_ids)
    local_tok = None
    if not why and upstreams.tokenize_local_bytes:
        local_tok = LocalTokenize(tokenizer, loaded, template, upstreams.tokenize_local_bytes)
        await local_tok.start()
        why = await local_tok.check(probe_ids)
    if why:
        raise SystemExit(f"router_svc: --tokenizer-files {files} is not the tokenizer service's tokenizer "
                         f"({why}); local (de)tokenization would send other ids or text than it")
    log.info("tokenizer_local", tokenizer=loaded.name, vocab=loaded.vocab_size,
             detokenize=upstreams.detokenize, tokenize_local_bytes=upstreams.tokenize_local_bytes)
    return (LocalDetokenize(loaded) if upstreams.detokenize == "local" else None), local_tok


def _placement(routing: RoutingSettings) -> tuple[Placement, PrefixIndex | None]:
    """The routing policy, and the prefix index it reads (the prefix policy only)."""
    if routing.routing_policy != "prefix":
        return make_policy(routing.routing_policy), None
    holds = routing.prefix_hold_cost > 0 and routing.prefix_hold_seconds > 0   # either 0: no holds at all
    index = PrefixIndex(pending_ttl=routing.prefix_pending_ttl,
                        live_window=routing.prefix_live_window if routing.prefix_evict_cost > 0 else 0.0,
                        hold_ttl=routing.prefix_hold_seconds if holds else 0.0)
    weights = PrefixWeights(routing.prefix_load_cost, routing.prefix_run_cost, routing.prefix_balance_ratio,
                            routing.prefix_balance_slack, evict_cost=routing.prefix_evict_cost,
                            hold_cost=routing.prefix_hold_cost if holds else 0.0)
    return PrefixAware(index, weights), index


async def serve(settings: RouterSettings) -> None:
    telemetry, upstreams = settings.telemetry, settings.upstreams
    configure_tracing("router_svc", telemetry.otlp_endpoint, trace_file=telemetry.trace_file)
    try:
        tenants = TenantsReloader(settings.tenants_file, settings.tenants_reload_interval)
    except TenantsFileError as exc:
        raise SystemExit(f"router_svc: {exc}") from None
    admission = Admission(settings.admission, router_id=settings.cluster.router_id)
    limits = settings.limits
    gate = OverloadGate(limits.max_requests_in_flight, limits.max_loop_lag_ms / 1000,
                        max_accept_wait=limits.max_accept_wait_ms / 1000,
                        spin=IdleSpin(limits.idle_spin_ms / 1000) if limits.idle_spin_ms > 0 else None)
    # Request ids, Cancel and sessions across router processes: the admission section's Redis and pool.
    cluster = RedisCluster(settings.admission.redis_url, settings.admission.pool,
                           router_id=settings.cluster.router_id, op_timeout=min(settings.admission.op_timeout, 1.0),
                           request_id_ttl=settings.cluster.request_id_ttl, session_ttl=settings.cluster.session_ttl,
                           cancel_timeout=settings.cluster.cancel_timeout,
                           redis_options=settings.admission.redis_options(),
                           lean=settings.admission.redis_client == "lean")
    try:
        discovery = discovery_from_settings(upstreams, settings.routing, settings.admission, settings.security)
    except ValueError as exc:
        raise SystemExit(f"router_svc: {exc}") from None
    engines = discovery.pool
    tokenizer = TokenizerUpstream(await resolve_once(upstreams.tokenizers), upstreams.upstream_timeout,
                                  max_calls=upstreams.tokenize_calls_in_flight,
                                  max_bytes=upstreams.tokenize_bytes_in_flight, security=settings.security)
    # dns: tokenizer entries followed while serving (a tokenizer Deployment scaled up or down).
    tokenizers = TokenizerDiscovery(upstreams.tokenizers, tokenizer, upstreams.dns_interval)
    feeds: KvEventFeeds | None = None
    local_detok: LocalDetokenize | None = None
    local_tok: LocalTokenize | None = None
    share: PlacementShare | None = None
    pools: PoolControl | None = None
    try:
        await tenants.start()  # before the slow waits, so a SIGHUP during startup reloads, not kills
        await cluster.start()
        await _wait_tokenizer(tokenizer, upstreams.startup_timeout)
        local_detok, local_tok = await _local_tokenizer(upstreams, tokenizer)
        tokenizers.start()
        await discovery.start()   # static and dns: entries, the registry: before the first poll
        await engines.start()
        placement, index = _placement(settings.routing)
        if index is not None:   # the engines' KV events keep the prefix index current
            feeds = KvEventFeeds(index, lambda address: engines.replica(address).stub)
            feeds.sync(r.address for r in engines.replicas)
            if hasattr(engines, "add_listener"):
                engines.add_listener(feeds.on_membership)
        if settings.routing.share_placements:
            # Placements and in-flight counts shared with the other routers (docs/routing.md, "Several
            # routers"); a router of another policy shares its in-flight counts only.
            share = PlacementShare(cluster.redis, cluster.pipe, settings.admission.pool, cluster.router_id,
                                   index, lambda: {s.address: s.in_flight for s in engines.snapshots()},
                                   op_timeout=cluster.op_timeout)
            if isinstance(placement, PrefixAware):
                placement.remote_in_flight = share.remote_in_flight
            engines.on_release = share.changed
            await share.start()
        # Engine pools: the traffic split (shared through Redis, changed at runtime) and shadow traffic.
        pools = PoolControl(settings.pools, settings.admission, EnginesAdapter(engines), placement,
                            lambda: list(tokenizer.meta.eos_token_ids) if tokenizer.meta else [])
        await pools.start()
        adm = settings.admission
        await admission.start()
        gate.start()
        router = build_router(
            local_tok or tokenizer, engines, admission, request_timeout=limits.request_timeout,
            engine_attempts=settings.routing.engine_attempts,
            progress_timeout=settings.routing.engine_progress_timeout,
            bounds=Bounds(limits.max_session_id, limits.max_model_name, limits.max_messages,
                          limits.max_role_chars, limits.max_content_chars, limits.default_max_tokens,
                          limits.max_stream_requests),
            gate=gate, registry=cluster.registry, affinity=cluster.sessions,
            default_max_queued=adm.default_max_queued, placement=placement,
            engine_migrations=settings.routing.engine_migrations, pools=pools.selector, shadow=pools.shadow,
            admit_while_tokenizing=adm.admit_while_tokenizing, detokenize=local_detok,
            chat_prefetch_max_in_flight=upstreams.chat_prefetch_max_in_flight)
        server = GrpcServer(settings.server.host, settings.server.port, [SERVICE_NAME], [ServerTracingInterceptor()],
                            security=settings.security, reuse_port=settings.cluster.reuse_port)
        add_to_server(InferenceServicer(router, tenants), server.server)
        await server.start()
        gate.probe_server(AcceptProbe(server.address, settings.security))   # the wait loop lag cannot see
        metrics_port = start_metrics_server(settings.server.host, telemetry.metrics_port)
        write_port_file(telemetry.metrics_port_file, metrics_port)
        frozen = gcstats.settle()   # startup's objects out of the collector's way (services/gcstats.py)
        write_port_file(settings.server.port_file, server.port)
        log.info("listening", address=server.address, metrics_port=metrics_port, gc_frozen=frozen,
                 tenants=len(tenants.registry.tenants), engines=upstreams.engines, tokenizers=upstreams.tokenizers,
                 idle_spin_ms=limits.idle_spin_ms)
        await wait_for_shutdown_signal()
        log.info("shutting_down", in_flight=router.in_flight)
        await server.stop(settings.server.shutdown_grace)
    finally:
        if pools is not None:
            await pools.close()
        if feeds is not None:
            await feeds.close()
        if share is not None:
            await share.close()
        await tenants.close()
        await gate.close()
        await cluster.close()
        await discovery.close()
        await engines.close()
        await tokenizers.close()
        await tokenizer.close()
        if local_detok is not None:
            local_detok.close()
        if local_tok is not None:
            await local_tok.close()
        await admission.close()
