"""router_svc settings: flags > TOKENRELAY_ROUTER_* environment > config file > defaults."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from services.config import Section, ServiceSettings, conflict, section

from .admission import AdmissionSettings
from .discovery import parse_entry
from .pools import format_weights, parse_weights
from .tokenize_batch import MAX_BYTES, MAX_CALLS
from .validation import DEFAULT_MAX_TOKENS


class UpstreamSettings(Section):
    """Where the tokenizer and engine replicas are, and how calls to them are batched and bounded."""

    tokenizers: list[str] = Field(default_factory=list, description="tokenizer_svc addresses: host:port, or "
                                                                    "dns:host:port (every A/AAAA record one "
                                                                    "replica; resolved once at start)")
    engines: list[str] = Field(default_factory=list, description="engine_svc replicas, [pool@]address each (no "
                                                                 "pool = 'default'): host:port, or dns:host:port "
                                                                 "(every A/AAAA record one replica, re-resolved "
                                                                 "every --dns-interval; a Kubernetes headless "
                                                                 "service). With --engine-registry, may be empty")
    engine_registry: bool = Field(False, description="also follow the engines that register themselves in Redis "
                                                     "(the admission --redis-url and --pool; engine_svc "
                                                     "--registry-redis-url): new ones join, those that miss "
                                                     "their heartbeats leave; Redis down = keep the last set")
    engine_frames: bool = Field(True, description="open the stream to an engine on its frame port when it has "
                                                  "one (engine_svc --frame-port; told in its load polls) and this "
                                                  "router's engine channels are plaintext: the same messages "
                                                  "without gRPC, fewer thread hand-offs each; an engine whose "
                                                  "frame port does not answer gets gRPC for 30 s")
    registry_interval: float = Field(1.0, ge=0.05, le=60, description="seconds between reads of the engine "
                                                                      "registry (one Redis call each)")
    dns_interval: float = Field(5.0, ge=0.1, le=3600, description="seconds between lookups of dns: entries of "
                                                                  "--engines and --tokenizers (a failed lookup "
                                                                  "keeps the last set)")
    upstream_timeout: float = Field(10.0, gt=0, description="timeout of unary calls to the tokenizer")
    startup_timeout: float = Field(60.0, gt=0, description="seconds to wait for upstreams at start")
    tokenize_calls_in_flight: int = Field(
        MAX_CALLS, ge=1, description="most batched Tokenize calls in flight per tokenizer replica (what waits "
                                     "is spread over 2, more only when that many full calls wait); requests "
                                     "that arrive meanwhile wait and share the next calls")
    tokenize_bytes_in_flight: int = Field(
        MAX_BYTES, ge=1, description="most input bytes in Tokenize calls in flight per tokenizer replica "
                                     "(below the replica's --max-pending-bytes)")

    detokenize: Literal["tokenizer", "local"] = Field(
        "tokenizer", description="where replies are detokenized: tokenizer (the tokenizer service's multiplexed "
                                 "Detokenize stream) or local (in this process, from --tokenizer-files: one hop "
                                 "less per token, measured in docs/benchmarks.md; prompts are still tokenized by "
                                 "the tokenizer service)")
    tokenizer_files: str = Field("", max_length=4096, description="with --detokenize local: the model directory "
                                 "or tokenizer.json the tokenizer service serves (checked against it at start)")

    tokenize_local_bytes: int = Field(
        0, ge=0, le=1 << 20, description="tokenize prompts of at most this many bytes (a text, or a chat's roles "
                                         "and contents) in this process from --tokenizer-files, longer ones at the "
                                         "tokenizer service (0 = all there; router_svc/local_tokenize.py)")
    tokenizer_chat_template: str = Field("", max_length=4096, description="with --tokenize-local-bytes: the "
                                         "--chat-template override the tokenizer service runs with, if any")
    chat_prefetch_max_in_flight: int = Field(
        32, ge=0, le=1_000_000, description="with --tokenize-local-bytes: once a chat turn's reply is done, "
                                            "tokenize its conversation with that reply ahead of the next turn, "
                                            "which then encodes only its new message, while this router has at "
                                            "most this many requests in flight, that turn included (0 = never)")

    @model_validator(mode="after")
    def _local_detokenize(self) -> UpstreamSettings:
        if self.detokenize == "local" and not self.tokenizer_files:
            raise conflict("--detokenize local needs --tokenizer-files (the tokenizer service's files)",
                           "detokenize", "tokenizer_files")
        if self.tokenize_local_bytes and not self.tokenizer_files:
            raise conflict("--tokenize-local-bytes needs --tokenizer-files (the tokenizer service's files)",
                           "tokenize_local_bytes", "tokenizer_files")
        return self

    @field_validator("tokenizers")
    @classmethod
    def _addresses(cls, addresses: list[str]) -> list[str]:
        for address in addresses:
            if not address.strip() or ":" not in address or "@" in address:
                raise ValueError(f"{address!r} is not an address (host:port, unix:PATH or dns:host:port)")
        return addresses

    @field_validator("engines")
    @classmethod
    def _entries(cls, entries: list[str]) -> list[str]:
        for entry in entries:
            parse_entry(entry)   # ValueError says what is wrong
        return entries


class RoutingSettings(Section):
    """How requests are placed on engine replicas."""

    engine_poll_interval: float = Field(1.0, gt=0, le=60, description="seconds between engine load polls "
                                                                     "(GetLoad: load, readiness, and the circuit "
                                                                     "breakers' failures and probes)")
    engine_poll_timeout: float = Field(2.0, gt=0, le=60, description="seconds a load poll may take before it "
                                                                     "counts as a failure of the replica")
    breaker_failures: int = Field(3, ge=1, le=1000, description="consecutive failures of an engine replica (stream "
                                                                "broken or stalled, load poll failed) that open its "
                                                                "circuit breaker: out of rotation for a backoff")
    breaker_backoff: float = Field(1.0, gt=0, le=600, description="seconds an engine replica's breaker stays open "
                                                                  "the first time; doubled on each reopening "
                                                                  "(after that, one probe: a poll or a request)")
    breaker_max_backoff: float = Field(30.0, gt=0, le=3600, description="longest an engine replica's breaker "
                                                                        "stays open (cap of the doubling)")
    engine_attempts: int = Field(2, ge=1, le=16, description="replicas to try when an engine fails before the "
                                                             "first token")
    engine_wake_delay: float = Field(
        0.02, ge=0, le=0.2, description="seconds a busy router (event-loop lag above 1 ms) may hold a request's "
                                        "new engine tokens so they travel on together: at most one delta per "
                                        "request per interval under load, none held when idle (0 = never)")
    engine_progress_timeout: float = Field(
        10.0, gt=0, le=600, description="seconds an engine may send nothing for a request while its stream is "
                                        "silent too (engines send a keepalive every second while they hold "
                                        "requests, so a request queued inside a live engine waits): before the "
                                        "first token the attempt counts as broken (retried on another replica), "
                                        "after it the request fails with ENGINE_STALLED")

    @model_validator(mode="after")
    def _backoffs(self) -> RoutingSettings:
        if self.breaker_max_backoff < self.breaker_backoff:
            raise conflict("--breaker-max-backoff must be at least --breaker-backoff", "breaker_max_backoff",
                           "breaker_backoff")
        return self
    engine_migrations: int = Field(
        2, ge=0, le=16, description="times a request may move to another replica after its first token when its "
                                    "replica breaks or stalls (prompt + tokens so far resubmitted; the client gets "
                                    "a `migrated` event; 0 = fail the request instead)")
    routing_policy: Literal["prefix", "least-loaded", "round-robin", "random", "session"] = Field(
        "prefix", description="placement: prefix (prefix-cache hits from the engines' KV events weighed against "
                              "load), least-loaded, round-robin, random, session (sticky else round-robin); "
                              "every policy keeps sessions on their replica unless it is saturated")
    prefix_load_cost: float = Field(
        256.0, ge=0, le=1_000_000, description="prefix policy: prompt tokens of prefill that one request a new "
                                               "one would wait behind (the replica's batch full) is worth")
    prefix_run_cost: float = Field(
        16.0, ge=0, le=1_000_000, description="prefix policy: prompt tokens of prefill that one request running "
                                              "on a replica is worth (it shares every step; higher = balance "
                                              "load over cache hits)")
    prefix_balance_ratio: float = Field(
        1.25, ge=1, le=100, description="prefix policy: a replica is a candidate only while its "
                                        "requests are at most this times the least loaded replica's (or that "
                                        "plus --prefix-balance-slack)")
    prefix_balance_slack: int = Field(1, ge=0, le=10_000, description="prefix policy: see --prefix-balance-ratio")
    prefix_evict_cost: float = Field(
        0.0, ge=0, le=1_000, description="prefix policy: prompt tokens of prefill that one token of other "
                                         "conversations in progress on a replica is worth where they could "
                                         "outgrow its KV cache (4x what it holds plus the request exceeds its "
                                         "blocks): they grow there and compete for its blocks; 0 = off, the default "
                                         "(0.1 measured no gain on bench_routing.py's evict trace, docs/routing.md)")
    prefix_live_window: float = Field(
        0.5, ge=0, le=3600, description="prefix policy: seconds a cached block touched by a placement or a KV "
                                        "event counts as a conversation's in progress (see "
                                        "--prefix-evict-cost); older cached blocks are stale")
    prefix_hold_seconds: float = Field(
        0.5, ge=0, le=600, description="prefix policy: seconds a replica stays held for a conversation's next "
                                       "turn after a turn ends there (a prompt that extends the last one "
                                       "consumes the hold); 0 = no holds")
    prefix_hold_cost: float = Field(
        512.0, ge=0, le=1_000_000, description="prefix policy: prompt tokens of prefill a fresh hold of another "
                                               "conversation on a replica is worth to a new request (down "
                                               "linearly to 0 over --prefix-hold-seconds); 0 = off")
    prefix_pending_ttl: float = Field(
        5.0, ge=0, le=600, description="prefix policy: seconds a prompt routed to a replica counts as cached "
                                       "there before its KV events arrive")
    share_placements: bool = Field(
        True, description="publish this router's placements and in-flight counts to the other routers of the "
                          "admission --pool through Redis pub/sub, and (prefix policy) enter theirs, so every "
                          "router sees a placement within milliseconds, before the engines' KV events, and "
                          "weighs the same load; every router of a pool should share, or none (Redis down: "
                          "each router routes on its own view)")


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
    idle_spin_ms: float = Field(
        0.0, ge=0, le=3_600_000, description="keep the event loop polling instead of sleeping while requests "
                                             "are in flight and for this many milliseconds after the last one "
                                             "(lower latency at light load for a core of the router's own; "
                                             "0 = off; docs/architecture.md, 'Idle spin')")
    max_session_id: int = Field(128, ge=1, le=4096, description="longest session_id (characters)")
    max_stream_requests: int = Field(1024, ge=1, le=100_000, description="most requests in flight on one "
                                                                         "Stream call (more are refused "
                                                                         "RESOURCE_EXHAUSTED/STREAM_FULL)")
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


class PoolSettings(Section):
    """Engine pools: the weighted traffic split between them and shadow traffic (router_svc/pools.py,
    router_svc/shadow.py). `tokenrelay split set` overrides these at runtime through Redis, for every
    router of the admission pool; `tokenrelay split reset` returns to them."""

    traffic_split: str = Field("default=100", max_length=2048,
                               description="engine pools and their weights, e.g. default=90,canary=10 (an "
                                           "engine's pool: [pool@]host:port in --engines, else 'default')")
    split_sticky: Literal["session", "tenant", "request"] = Field(
        "session", description="what a request's pool is a function of: its session (else its tenant), its "
                               "tenant, or the request alone (no stickiness)")
    split_poll_interval: float = Field(2.0, ge=0.1, le=300, description="seconds between reads of the split "
                                                                        "in Redis (a change is also announced "
                                                                        "on pub/sub)")
    shadow_pool: str = Field("", max_length=64, pattern=r"^[A-Za-z0-9._-]*$",
                             description="engine pool that requests are mirrored to (its answers are recorded, "
                                         "never returned; empty = no shadow traffic)")
    shadow_fraction: float = Field(0.0, ge=0, le=1, description="share of requests mirrored to --shadow-pool")
    shadow_max_in_flight: int = Field(64, ge=1, le=100_000, description="most shadow requests this router has "
                                                                        "in flight; more are dropped (counted)")
    shadow_timeout: float = Field(120.0, gt=0, le=3600, description="seconds a shadow request may take at most "
                                                                    "(also bounded by its primary's deadline)")
    shadow_record_stream: int = Field(0, ge=0, le=10_000_000, description="keep the last N shadow records in "
                                                                          "the Redis stream tq:{pool}:shadow "
                                                                          "(0 = log and metrics only)")

    @field_validator("traffic_split")
    @classmethod
    def _split(cls, value: str) -> str:
        return format_weights(parse_weights(value))


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
    pools: PoolSettings = section(PoolSettings, "engine pools (traffic split, shadow traffic)")

    @field_validator("tenants_file")
    @classmethod
    def _required(cls, path: str) -> str:
        if not path:
            raise ValueError("is required")
        return path
