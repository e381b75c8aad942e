"""router_svc settings (flags > TOKENRELAY_ROUTER_* environment variables > defaults)."""

from __future__ import annotations

from dataclasses import dataclass

from services.config import setting

from .tokenize_batch import MAX_BYTES, MAX_CALLS


@dataclass
class RouterSettings:
    """The client-facing front door of tokenrelay."""

    host: str = setting("127.0.0.1", "address to bind")
    port: int = setting(0, "port to bind (0 = ephemeral; see --port-file)")
    port_file: str = setting("", "write the bound port here once serving")
    tokenizers: list[str] = setting([], "tokenizer_svc addresses, comma-separated host:port")
    engines: list[str] = setting([], "engine_svc addresses, comma-separated host:port")
    redis_url: str = setting("redis://127.0.0.1:6379/0", "Redis URL (redis://, rediss://, unix://)")
    tenants_file: str = setting("", "tenants YAML/TOML file (API key hashes and limits)")
    pool: str = setting("default", "admission pool name (Redis key hash tag)")
    lease_ttl: float = setting(15.0, "seconds a request lease lives without a heartbeat")
    fail_open: bool = setting(False, "admit requests when Redis is unreachable (default: reject)")
    request_timeout: float = setting(600.0, "default request deadline when the client sets none")
    upstream_timeout: float = setting(10.0, "timeout of unary calls to the tokenizer")
    tokenize_calls_in_flight: int = setting(MAX_CALLS, "most batched Tokenize calls in flight per tokenizer "
                                                       "replica (what waits is spread over 2, more only when "
                                                       "that many full calls wait); requests that arrive "
                                                       "meanwhile wait and share the next calls")
    tokenize_bytes_in_flight: int = setting(MAX_BYTES, "most input bytes in Tokenize calls in flight per tokenizer "
                                                       "replica (below the replica's --max-pending-bytes)")
    engine_poll_interval: float = setting(1.0, "seconds between engine load polls")
    engine_attempts: int = setting(2, "replicas to try when an engine fails before the first token")
    startup_timeout: float = setting(60.0, "seconds to wait for upstreams at start")
    metrics_port: int = setting(-1, "Prometheus /metrics port (0 = ephemeral, -1 = off)")
    metrics_port_file: str = setting("", "write the bound metrics port here")
    otlp_endpoint: str = setting("", "OTLP gRPC endpoint for traces (empty = no export)")
    log_level: str = setting("INFO", "log level")
    log_format: str = setting("json", "json | console")
    shutdown_grace: float = setting(10.0, "seconds in-flight streams get to finish on SIGTERM")
