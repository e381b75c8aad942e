from services.proto.tokenrelay.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EngineHealth(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENGINE_HEALTH_UNSPECIFIED: _ClassVar[EngineHealth]
    ENGINE_HEALTH_SERVING: _ClassVar[EngineHealth]
    ENGINE_HEALTH_DRAINING: _ClassVar[EngineHealth]
    ENGINE_HEALTH_DEAD: _ClassVar[EngineHealth]
    ENGINE_HEALTH_UNAVAILABLE: _ClassVar[EngineHealth]

class KvEventType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_EVENT_TYPE_UNSPECIFIED: _ClassVar[KvEventType]
    KV_EVENT_STORED: _ClassVar[KvEventType]
    KV_EVENT_REMOVED: _ClassVar[KvEventType]
    KV_EVENT_CREATED: _ClassVar[KvEventType]
    KV_EVENT_UPDATED: _ClassVar[KvEventType]
ENGINE_HEALTH_UNSPECIFIED: EngineHealth
ENGINE_HEALTH_SERVING: EngineHealth
ENGINE_HEALTH_DRAINING: EngineHealth
ENGINE_HEALTH_DEAD: EngineHealth
ENGINE_HEALTH_UNAVAILABLE: EngineHealth
KV_EVENT_TYPE_UNSPECIFIED: KvEventType
KV_EVENT_STORED: KvEventType
KV_EVENT_REMOVED: KvEventType
KV_EVENT_CREATED: KvEventType
KV_EVENT_UPDATED: KvEventType

class EngineRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "eos_token_ids", "cache_salt", "trace_context", "timeout_ms", "priority")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: str
    trace_context: _containers.ScalarMap[str, str]
    timeout_ms: int
    priority: _common_pb2.Priority
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[str] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., timeout_ms: _Optional[int] = ..., priority: _Optional[_Union[_common_pb2.Priority, str]] = ...) -> None: ...

class EngineInbound(_message.Message):
    __slots__ = ("submit", "abort")
    SUBMIT_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    submit: _containers.RepeatedCompositeFieldContainer[EngineRequest]
    abort: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, submit: _Optional[_Iterable[_Union[EngineRequest, _Mapping]]] = ..., abort: _Optional[_Iterable[str]] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("request_id", "token_ids", "finished", "finish_reason", "cached_tokens", "error_reason", "error_message")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ERROR_REASON_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finished: bool
    finish_reason: _common_pb2.FinishReason
    cached_tokens: int
    error_reason: str
    error_message: str
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., cached_tokens: _Optional[int] = ..., error_reason: _Optional[str] = ..., error_message: _Optional[str] = ...) -> None: ...

class EngineOutbound(_message.Message):
    __slots__ = ("chunks", "load")
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    chunks: _containers.RepeatedCompositeFieldContainer[TokenChunk]
    load: LoadReport
    def __init__(self, chunks: _Optional[_Iterable[_Union[TokenChunk, _Mapping]]] = ..., load: _Optional[_Union[LoadReport, _Mapping]] = ...) -> None: ...

class EngineAbortRequest(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class EngineAbortResponse(_message.Message):
    __slots__ = ("aborted",)
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    aborted: int
    def __init__(self, aborted: _Optional[int] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoadReport(_message.Message):
    __slots__ = ("backend", "model", "active_requests", "queued_requests", "max_active_requests", "kv_blocks_total", "kv_blocks_used", "tokens_per_block", "max_context", "prompt_tokens_total", "cached_tokens_total", "generated_tokens_total", "draining", "health", "stats", "frame_port")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MAX_ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    FRAME_PORT_FIELD_NUMBER: _ClassVar[int]
    backend: str
    model: str
    active_requests: int
    queued_requests: int
    max_active_requests: int
    kv_blocks_total: int
    kv_blocks_used: int
    tokens_per_block: int
    max_context: int
    prompt_tokens_total: int
    cached_tokens_total: int
    generated_tokens_total: int
    draining: bool
    health: EngineHealth
    stats: IterationStats
    frame_port: int
    def __init__(self, backend: _Optional[str] = ..., model: _Optional[str] = ..., active_requests: _Optional[int] = ..., queued_requests: _Optional[int] = ..., max_active_requests: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., tokens_per_block: _Optional[int] = ..., max_context: _Optional[int] = ..., prompt_tokens_total: _Optional[int] = ..., cached_tokens_total: _Optional[int] = ..., generated_tokens_total: _Optional[int] = ..., draining: _Optional[bool] = ..., health: _Optional[_Union[EngineHealth, str]] = ..., stats: _Optional[_Union[IterationStats, _Mapping]] = ..., frame_port: _Optional[int] = ...) -> None: ...

class IterationStats(_message.Message):
    __slots__ = ("iteration", "active_requests", "queued_requests", "kv_blocks_total", "kv_blocks_used", "kv_blocks_free", "kv_blocks_reused", "kv_blocks_missed", "kv_cache_hit_rate", "context_requests", "generation_requests", "paused_requests", "iteration_latency_ms")
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_REUSED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_MISSED_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PAUSED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    ITERATION_LATENCY_MS_FIELD_NUMBER: _ClassVar[int]
    iteration: int
    active_requests: int
    queued_requests: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_free: int
    kv_blocks_reused: int
    kv_blocks_missed: int
    kv_cache_hit_rate: float
    context_requests: int
    generation_requests: int
    paused_requests: int
    iteration_latency_ms: float
    def __init__(self, iteration: _Optional[int] = ..., active_requests: _Optional[int] = ..., queued_requests: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., kv_blocks_free: _Optional[int] = ..., kv_blocks_reused: _Optional[int] = ..., kv_blocks_missed: _Optional[int] = ..., kv_cache_hit_rate: _Optional[float] = ..., context_requests: _Optional[int] = ..., generation_requests: _Optional[int] = ..., paused_requests: _Optional[int] = ..., iteration_latency_ms: _Optional[float] = ...) -> None: ...

class KvEventsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KvEventBatch(_message.Message):
    __slots__ = ("events", "dropped_events", "info")
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_EVENTS_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[KvCacheEvent]
    dropped_events: int
    info: KvEventsInfo
    def __init__(self, events: _Optional[_Iterable[_Union[KvCacheEvent, _Mapping]]] = ..., dropped_events: _Optional[int] = ..., info: _Optional[_Union[KvEventsInfo, _Mapping]] = ...) -> None: ...

class KvEventsInfo(_message.Message):
    __slots__ = ("backend", "model", "enabled", "tokens_per_block")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    backend: str
    model: str
    enabled: bool
    tokens_per_block: int
    def __init__(self, backend: _Optional[str] = ..., model: _Optional[str] = ..., enabled: _Optional[bool] = ..., tokens_per_block: _Optional[int] = ...) -> None: ...

class KvCacheEvent(_message.Message):
    __slots__ = ("event_id", "type", "window_size", "parent_hash", "blocks", "block_hashes", "num_blocks_per_cache_level", "cache_salt")
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    WINDOW_SIZE_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_PER_CACHE_LEVEL_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    event_id: int
    type: KvEventType
    window_size: int
    parent_hash: int
    blocks: _containers.RepeatedCompositeFieldContainer[KvBlock]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    num_blocks_per_cache_level: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: str
    def __init__(self, event_id: _Optional[int] = ..., type: _Optional[_Union[KvEventType, str]] = ..., window_size: _Optional[int] = ..., parent_hash: _Optional[int] = ..., blocks: _Optional[_Iterable[_Union[KvBlock, _Mapping]]] = ..., block_hashes: _Optional[_Iterable[int]] = ..., num_blocks_per_cache_level: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class KvBlock(_message.Message):
    __slots__ = ("block_hash", "tokens", "cache_level", "priority")
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_LEVEL_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    block_hash: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    cache_level: int
    priority: int
    def __init__(self, block_hash: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., cache_level: _Optional[int] = ..., priority: _Optional[int] = ...) -> None: ...
