"""router_svc settings: flags > TOKENRELAY_ROUTER_* environment > config file > defaults."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field, field_validator

from services.config import Section, ServiceSettings, section

from .admission import AdmissionSettings
from .tokenize_batch import MAX_BYTES, MAX_CALLS


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
    engine_attempts: int = Field(2, ge=1, description="replicas to try when an engine fails before the first "
                                                      "token")


class LimitSettings(Section):
    """Per-request limits the router applies itself (tenant limits are in the tenants file)."""

    request_timeout: float = Field(600.0, gt=0, description="default request deadline when the client sets none")


class RouterSettings(ServiceSettings):
    """router_svc: the client-facing front door of tokenrelay."""

    ENV_PREFIX: ClassVar[str] = "TOKENRELAY_ROUTER_"
    PROG: ClassVar[str] = "router_svc"

    tenants_file: str = Field("", validate_default=True, description="tenants YAML/TOML file (API key hashes "
                                                                     "and limits; required)")
    tenants_reload_interval: float = Field(5.0, ge=0, description="seconds between checks of the tenants file "
                                           "for changes (0 = reload on SIGHUP only)")
    upstreams: UpstreamSettings = section(UpstreamSettings, "upstreams")
    admission: AdmissionSettings = section(AdmissionSettings, "admission (Redis leases)")
    routing: RoutingSettings = section(RoutingSettings, "routing")
    limits: LimitSettings = section(LimitSettings, "limits")

    @field_validator("tenants_file")
    @classmethod
    def _required(cls, path: str) -> str:
        if not path:
            raise ValueError("is required")
        return path
