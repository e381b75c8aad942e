"""router_svc settings: flags > TOKENRELAY_ROUTER_* environment > config file > defaults."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field, field_validator

from services.config import Section, ServiceSettings, section

from .admission import AdmissionSettings
from .tokenize_batch import MAX_BYTES, MAX_CALLS
from .validation import DEFAULT_MAX_TOKENS


class UpstreamSettings(Section):
    """Where the tokenizer and engine replicas are, and how calls to them are batched and bounded."""

    tokenizers: list[str] = Field(default_factory=list, description="tokenizer_svc addresses, host:port")
    engines: list[str] = Field(default_factory=list, description="engine_svc addresses, host:port")
    upstream_timeout: float = Field(10.0, gt=0, description="timeout of unary calls to the tokenizer")
    startup_timeout: float = Field(60.0, gt=0, description="seconds to wait for upstreams at start")
    tokenize_calls_in_flight: int = Field(
        MAX_CALLS, ge=1, description="most batched Tokenize calls in flight per tokenizer replica (what waits "
                                     "is spread over 2, more only when that many full calls wait); requests "
                                     "that arrive meanwhile wait and share the next calls")
    tokenize_bytes_in_flight: int = Field(
        MAX_BYTES, ge=1, description="most input bytes in Tokenize calls in flight per tokenizer replica "
                                     "(below the replica's --max-pending-bytes)")

    @field_validator("tokenizers", "engines")
    @classmethod
    def _addresses(cls, addresses: list[str]) -> list[str]:
        for address in addresses:
            if not address.strip() or ":" not in address:
                raise ValueError(f"{address!r} is not an address (host:port, or unix:PATH)")
        return addresses


class RoutingSettings(Section):
    """How requests are placed on engine replicas."""

    engine_poll_interval: float = Field(1.0, gt=0, description="seconds between engine load polls")
    engine_attempts: int = Field(2, ge=1, le=16, description="replicas to try when an engine fails before the "
                                                             "first token")
    engine_wake_delay: float = Field(
        0.02, ge=0, le=0.2, description="seconds a busy router (event-loop lag above 1 ms) may hold a request's "
                                        "new engine tokens so they travel on together: at most one delta per "
                                        "request per interval under load, none held when idle (0 = never)")
    engine_progress_timeout: float = Field(
        10.0, gt=0, le=600, description="seconds an engine may send nothing for a request: before the first "
                                        "token the attempt counts as broken (retried on another replica), after "
                                        "it the request fails with ENGINE_STALLED")


class LimitSettings(Section):
    """Per-request limits the router applies itself (tenant limits are in the tenants file)."""

    request_timeout: float = Field(600.0, gt=0, description="default request deadline when the client sets none")
    max_requests_in_flight: int = Field(
        2048, ge=0, le=1_000_000, description="most Generate calls and chat turns this router process serves at "
                                              "once; more are refused at once with UNAVAILABLE/ROUTER_OVERLOADED "
                                              "and a retry-after (0 = no bound)")
    max_loop_lag_ms: float = Field(
        250.0, ge=0, le=60_000, description="refuse new calls (UNAVAILABLE/ROUTER_OVERLOADED) while this router's "
                                            "event loop lags more than this many milliseconds (0 = never)")
    max_accept_wait_ms: float = Field(
        0.0, ge=0, le=60_000, description="refuse new calls (UNAVAILABLE/ROUTER_OVERLOADED) while a health check this "
                                          "router sends itself every 250 ms takes longer than this many "
                                          "milliseconds (its accept path is that slow; 0 = measure only)")
    max_session_id: int = Field(128, ge=1, le=4096, description="longest session_id (characters)")
    max_model_name: int = Field(256, ge=1, le=4096, description="longest model name (characters)")
    max_messages: int = Field(1024, ge=1, le=100_000, description="most chat messages in one request or turn "
                                                                  "(a chat session's history included)")
    max_role_chars: int = Field(64, ge=1, le=4096, description="longest chat message role (characters)")
    max_content_chars: int = Field(1_000_000, ge=1, le=64_000_000, description="longest chat message "
                                                                               "content, and prompt (characters)")
    default_max_tokens: int = Field(
        DEFAULT_MAX_TOKENS, ge=1, le=1 << 20, description="max_tokens of a request that sets none (0 on the wire), "
                                                          "at most the tenant's max_tokens_cap and the context the "
                                                          "prompt leaves")


class ClusterSettings(Section):
    """Several router processes as one: shared port, request ids, Cancel and sessions through Redis
    (the admission section's Redis and pool; router_svc/cluster.py)."""

    reuse_port: bool = Field(False, description="bind the router's port with SO_REUSEPORT so several router "
                                                "processes serve one host:port (each must set it; `tokenrelay up "
                                                "--routers N` does)")
    router_id: str = Field("", max_length=128, pattern=r"^[A-Za-z0-9._:-]*$",
                           description="this process's id in Redis (owner of its request ids, its Cancel "
                                       "channel): unique per process; empty = hostname-pid-random")
    request_id_ttl: float = Field(15.0, ge=1, le=3600, description="seconds a request id stays claimed in Redis "
                                                                   "without its router's heartbeat (one heartbeat "
                                                                   "per process every third of it)")
    session_ttl: float = Field(3600.0, ge=1, le=7 * 86400, description="seconds a session's engine replica is "
                                                                       "remembered in Redis after its last turn")
    cancel_timeout: float = Field(0.5, gt=0, le=10, description="seconds a Cancel waits for the answer of the "
                                                                "router process holding the request")


class RouterSettings(ServiceSettings):
    """router_svc: the client-facing front door of tokenrelay."""

    ENV_PREFIX: ClassVar[str] = "TOKENRELAY_ROUTER_"
    PROG: ClassVar[str] = "router_svc"

    tenants_file: str = Field("", validate_default=True, description="tenants YAML/TOML file (API key hashes "
                                                                     "and limits; required)")
    tenants_reload_interval: float = Field(5.0, ge=0, description="seconds between checks of the tenants file "
                                           "for changes (0 = reload on SIGHUP only)")
    upstreams: UpstreamSettings = section(UpstreamSettings, "upstreams")
    admission: AdmissionSettings = section(AdmissionSettings, "admission (the queue shared through Redis)")
    routing: RoutingSettings = section(RoutingSettings, "routing")
    limits: LimitSettings = section(LimitSettings, "limits")
    cluster: ClusterSettings = section(ClusterSettings, "cluster (router processes sharing a port and Redis)")

    @field_validator("tenants_file")
    @classmethod
    def _required(cls, path: str) -> str:
        if not path:
            raise ValueError("is required")
        return path
