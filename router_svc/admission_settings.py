"""The router's admission section: where the queue lives, its classes, and how it is kept."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, field_validator, model_validator

from services.config import MaskedUrl, Section, conflict, flag
from services.security import check_ca_file, check_cert_file, check_key_file, check_pair

_PRIORITY_NAMES = {"low": 1, "normal": 2, "high": 3}


@dataclass(frozen=True)
class QueueClass:
    name: str
    min_share: float      # of the tokens granted while it waited (0 = strict priority only)
    max_queued: int       # requests of this class waiting, pool-wide


class AdmissionSettings(Section):
    """Admission: one Redis-backed queue per pool, shared by every router replica."""

    redis_url: MaskedUrl = Field("redis://127.0.0.1:6379/0", description="Redis URL (redis://, rediss://, "
                                 "unix://; redis+cluster://host:port or rediss+cluster:// for a Redis Cluster, "
                                 "one seed node, each pool's keys in one slot); a password in it is never logged")
    redis_ca_file: str = Field("", description="PEM CA certificates that verify the Redis server's certificate "
                               "(rediss:// URLs; empty = the system's roots); the server's name is checked "
                               "against the URL's host")
    redis_cert_file: str = Field("", description="PEM client certificate for a Redis that requires one "
                                 "(tls-auth-clients yes; rediss:// URLs)")
    redis_key_file: str = Field("", description="PEM private key of --redis-cert-file (unencrypted)")
    redis_password: SecretStr = Field(SecretStr(""), max_length=512, description="Redis password (AUTH), "
                                      "instead of one in --redis-url; never logged")
    pool: str = Field("default", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$",
                      description="admission pool name (the Redis keys' hash tag: one Cluster slot per pool)")
    lease_ttl: float = Field(15.0, gt=0, le=3600, description="seconds a lease (or a queued request) lives "
                             "without its router's heartbeat: a dead router's capacity returns after this")
    heartbeat_interval: float | None = Field(None, gt=0, json_schema_extra=flag("lease_heartbeat"),
                                             description="seconds between heartbeats of the leases (unset = a "
                                                         "third of --lease-ttl); one call for all of a process")
    fail_open: bool = Field(False, description="when Redis is unreachable, admit on this process's own limits "
                            "(tenant max_in_flight, pool capacity) instead of refusing with REDIS_UNAVAILABLE")
    op_timeout: float = Field(2.0, gt=0, le=60, description="seconds one Redis operation may take (time the "
                              "router's own event loop was stalled is not counted)",
                              json_schema_extra=flag("redis_timeout"))
    max_connections: int = Field(8, ge=2, le=256, json_schema_extra=flag("redis_max_connections"),
                                 description="Redis connections per router process (one bounded pool; "
                                             "operations wait for a free one)")
    redis_client: Literal["lean", "redis-py"] = Field(
        "lean", description="the client of the router's calls on a request's path (admission scripts, request-id "
                            "claims and releases, Cancel, sessions, shared placements): lean = one pipelined "
                            "connection that writes each call when it is made (router_svc/redis_scripts.py); "
                            "redis-py = the library's pool. A cluster URL always uses redis-py")
    queue_code: Literal["library", "scripts"] = Field(
        "library", description="how the admission queue's Lua runs in Redis: library = one function library, loaded "
                               "once (FUNCTION LOAD, again after a restart that lost it) and called by FCALL, its "
                               "shared functions defined once (a lone request's Redis time 0.77-0.88 of the "
                               "scripts', bench/bench_lua_cost.py --rounds); scripts = EVALSHA of self-contained "
                               "scripts, for a Redis or proxy that refuses FUNCTION and FCALL (an ACL, a managed "
                               "service)")
    queue_classes: str = Field(
        "interactive:0:4096,standard:0.1:4096,batch:0.05:4096",
        description="priority classes, highest first, as name:min_share:max_queued. Strict priority, except "
                    "that a backlogged class below min_share of the tokens granted while it waited goes first (so "
                    "it is slowed, never starved); max_queued bounds the class's queue, pool-wide")
    priority_classes: str = Field("high=interactive,normal=standard,low=batch",
                                  description="the class of each request priority (low, normal, high)")
    default_max_queued: int = Field(256, ge=0, le=1_000_000, description="requests a tenant may have queued "
                                    "when its tenants-file entry sets no max_queued")
    admit_while_tokenizing: bool = Field(
        True, description="send a text or chat request to admission while its prompt is being tokenized, with "
                          "its prompt tokens estimated from the characters-per-token this router has seen (the "
                          "settle charges what was used): the two round trips overlap instead of adding up. A "
                          "refusal of the token budget on an estimate above the real count is asked again "
                          "with the real count")
    max_queue_wait: float = Field(60.0, gt=0, le=3600, description="longest estimated wait (queue or token "
                                  "budget) a request is queued for; beyond it, or beyond its deadline, it is "
                                  "refused at once with a retry-after")
    budget_memo_ms: int = Field(500, ge=0, le=10_000, description="after Redis refuses a tenant's request for "
                                "its token budget, refuse that tenant's next requests that cannot fit it either "
                                "(their least possible cost against the debt Redis reported, refilled at the "
                                "tenant's rate, less this router's own refunds) for this long without a Redis "
                                "call, an id claim or a Tokenize; a refund at another router within the window "
                                "is seen at the next call (0 = ask Redis every time)")
    queue_memo_ms: int = Field(250, ge=0, le=10_000, description="after Redis reports a tenant's queue full "
                               "(a TENANT_QUEUE_FULL refusal, or a request queued as its last place), refuse "
                               "that tenant's next requests of the same class TENANT_QUEUE_FULL without a Redis "
                               "call until one of its requests queued at this router leaves the queue, for at "
                               "most this long: a slot freed at another router within the window is taken at "
                               "the next call (0 = ask Redis every time)")
    pool_capacity: int = Field(0, ge=0, le=1_000_000, description="requests the engine pool runs at once "
                               "(0 = from the engines' reports: each serving replica's batch size)")
    capacity_factor: float = Field(1.0, gt=0, le=16, description="dispatch up to this many times the engines' "
                                   "reported batch sizes (above 1, a small queue forms inside each engine)")
    fair_headroom: float = Field(0.0, ge=0, lt=1, description="share of the pool's capacity held back for "
                                 "tenants below their fair (weighted) share of it: a quiet tenant's request "
                                 "starts at once while a noisy tenant keeps the rest of the pool full. It costs "
                                 "that share of the engines when one tenant alone saturates them (0 = off; "
                                 "see docs/admission.md)")
    slot_hold_ms: int = Field(50, ge=0, le=1000, description="while others are queued, a tenant below its fair "
                              "share, or whose request outranks every queued class, keeps the slot its request "
                              "just freed this long for its next request (closed-loop clients come back within "
                              "milliseconds; without the hold the busiest tenant, or the batch class, takes "
                              "every slot that frees); 0 = off")
    kv_high_water: float = Field(0.95, gt=0, le=1, description="a replica whose KV cache is this full takes "
                                 "no more than it runs now")
    unknown_replica_capacity: int = Field(32, ge=1, le=100_000, description="batch size assumed for a serving "
                                          "replica that has not reported its load yet")
    reap_interval: float = Field(0.25, gt=0, le=60, description="seconds between a router's housekeeping calls "
                                 "(expired leases and deadlines, token budgets that refilled)")
    queue_poll: float = Field(1.0, gt=0, le=60, description="seconds between position updates (and keep-alives) "
                              "of this router's queued requests")

    @field_validator("redis_url")
    @classmethod
    def _scheme(cls, url: str) -> str:
        if not url.startswith(("redis://", "rediss://", "unix://", "redis+cluster://", "rediss+cluster://")):
            raise ValueError("must start with redis://, rediss://, unix://, redis+cluster:// or rediss+cluster://")
        return url

    @field_validator("redis_ca_file")
    @classmethod
    def _redis_ca(cls, path: str) -> str:
        return check_ca_file(path) if path else path

    @field_validator("redis_cert_file")
    @classmethod
    def _redis_cert(cls, path: str) -> str:
        return check_cert_file(path) if path else path

    @field_validator("redis_key_file")
    @classmethod
    def _redis_key(cls, path: str) -> str:
        return check_key_file(path) if path else path

    @field_validator("queue_classes")
    @classmethod
    def _classes(cls, value: str) -> str:
        _parse_classes(value)
        return value

    @model_validator(mode="after")
    def _consistent(self) -> AdmissionSettings:
        if self.heartbeat_interval is not None and self.heartbeat_interval >= self.lease_ttl:
            raise conflict("the lease heartbeat must be shorter than the lease TTL", "heartbeat_interval",
                           "lease_ttl")
        if self.queue_poll >= self.lease_ttl:
            raise conflict("queued requests' keep-alive (--queue-poll) must be shorter than the lease TTL",
                           "queue_poll", "lease_ttl")
        self._redis_tls_consistent()
        names = {c.name for c in _parse_classes(self.queue_classes)}
        mapping = _parse_mapping(self.priority_classes)
        unknown = sorted(set(mapping.values()) - names)
        if unknown:
            raise conflict(f"priority_classes names classes not in queue_classes: {', '.join(unknown)}",
                           "priority_classes", "queue_classes")
        return self

    def _redis_tls_consistent(self) -> None:
        tls = [f for f in ("redis_ca_file", "redis_cert_file", "redis_key_file") if getattr(self, f)]
        if tls and not self.redis_url.startswith(("rediss://", "rediss+cluster://")):
            raise conflict(f"{', '.join(tls)} need a rediss:// URL (TLS)", "redis_url", *tls)
        if bool(self.redis_cert_file) != bool(self.redis_key_file):
            raise conflict("set both a client certificate and its key, or neither", "redis_cert_file",
                           "redis_key_file")
        if self.redis_cert_file and (problem := check_pair(self.redis_cert_file, self.redis_key_file)):
            raise conflict(problem, "redis_cert_file", "redis_key_file")
        if self.redis_password.get_secret_value() and _url_has_password(self.redis_url):
            raise conflict("the Redis password is given twice: in the URL and as --redis-password", "redis_url",
                           "redis_password")

    def redis_options(self) -> dict[str, Any]:
        """Keyword arguments of redis-py's clients and pools for this section's TLS files and password
        (every Redis client of the router is opened with them)."""
        options: dict[str, Any] = {}
        if self.redis_ca_file:
            options["ssl_ca_certs"] = self.redis_ca_file
        if self.redis_cert_file:
            options["ssl_certfile"], options["ssl_keyfile"] = self.redis_cert_file, self.redis_key_file
        if self.redis_password.get_secret_value():
            options["password"] = self.redis_password.get_secret_value()
        return options

    @property
    def heartbeat(self) -> float:
        return self.heartbeat_interval if self.heartbeat_interval is not None else self.lease_ttl / 3

    def class_table(self) -> list[QueueClass]:
        return _parse_classes(self.queue_classes)

    def class_for(self, priority: int) -> str:
        """The class of a resolved priority (1 low, 2 normal, 3 high)."""
        mapping = _parse_mapping(self.priority_classes)
        return mapping[{v: k for k, v in _PRIORITY_NAMES.items()}.get(priority, "normal")]


def _parse_classes(value: str) -> list[QueueClass]:
    out: list[QueueClass] = []
    for part in (p.strip() for p in value.split(",") if p.strip()):
        bits = part.split(":")
        if len(bits) != 3:
            raise ValueError(f"{part!r} is not name:min_share:max_queued")
        name, share, maxq = bits
        if not name.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"class name {name!r} must be letters, digits, '-' or '_'")
        try:
            min_share, max_queued = float(share), int(maxq)
        except ValueError:
            raise ValueError(f"{part!r}: min_share must be a number and max_queued an integer") from None
        if not 0 <= min_share < 1 or not 0 <= max_queued <= 10_000_000:
            raise ValueError(f"{part!r}: min_share must be in [0, 1) and max_queued in [0, 10000000]")
        out.append(QueueClass(name, min_share, max_queued))
    if not out:
        raise ValueError("at least one class is needed")
    if len({c.name for c in out}) != len(out):
        raise ValueError("class names must be unique")
    if sum(c.min_share for c in out[1:]) >= 1:
        raise ValueError("the lower classes' min_share must sum to less than 1")
    return out


def _parse_mapping(value: str) -> dict[str, str]:
    mapping: dict[str, str] = {}
    for part in (p.strip() for p in value.split(",") if p.strip()):
        prio, _, name = part.partition("=")
        if prio not in _PRIORITY_NAMES or not name:
            raise ValueError(f"{part!r} is not low|normal|high=CLASS")
        mapping[prio] = name
    missing = sorted(set(_PRIORITY_NAMES) - set(mapping))
    if missing:
        raise ValueError(f"priority_classes needs a class for {', '.join(missing)}")
    return mapping


def _url_has_password(url: str) -> bool:
    try:
        return bool(urlsplit(url).password)
    except ValueError:
        return False
