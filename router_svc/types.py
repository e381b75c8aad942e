"""Domain types of the router: what a request is, and the events a generation yields.

No grpc or protobuf here: the servicer converts at the edge, upstream adapters convert at theirs.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Sampling:
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 0.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str: bool = False


@dataclass
class GenerateInput:
    sampling: Sampling
    prompt: str | None = None
    messages: list[tuple[str, str]] | None = None
    token_ids: list[int] | None = None
    priority: int = 0
    session_id: str = ""
    return_token_ids: bool = False
    request_id: str = ""
    model: str = ""
    # Coarser deltas for service-to-service callers: a delta waits until it holds this many tokens
    # or this long has passed since the last one (the final delta never waits). 0 = off.
    min_delta_tokens: int = 0
    min_delta_interval_ms: int = 0


@dataclass
class Usage:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class Timings:
    queue_seconds: float = 0.0
    ttft_seconds: float = 0.0
    total_seconds: float = 0.0
    tokenize_seconds: float = 0.0
    decode_seconds: float = 0.0


@dataclass
class Accepted:
    request_id: str
    prompt_tokens: int
    queue_position: int = 0


@dataclass
class Delta:
    text: str
    token_ids: list[int] = field(default_factory=list)


@dataclass
class Done:
    finish_reason: str  # "length" | "stop" | "cancelled" | "error"
    usage: Usage
    timings: Timings
    stop_reason: str = ""


@dataclass
class Migrated:
    """The request moved to another engine replica after its first token; the stream goes on."""

    migrations: int
    tokens_so_far: int
    reason: str


@dataclass
class TurnError:
    """A chat turn failed; the session goes on (ChatResponse.turn_error)."""

    reason: str
    code: str          # the gRPC status code's name, e.g. "INVALID_ARGUMENT"
    message: str
    retry_after: float | None = None
    request_id: str = ""   # the failed turn's id; "" for a turn refused before it started


Event = Accepted | Delta | Done | Migrated


@dataclass
class EngineChunk:
    token_ids: list[int]
    finished: bool = False
    finish_reason: str = ""
    cached_tokens: int = 0
    error_reason: str = ""
    error_message: str = ""


@dataclass
class DetokOut:
    text: str
    finished: bool = False
    matched_stop: str = ""
    tokens_consumed: int = 0
    error: str = ""


@dataclass
class TokenizerMeta:
    name: str
    vocab_size: int
    eos_token_ids: list[int]
    bos_token_id: int | None
    max_context: int
    has_chat_template: bool
