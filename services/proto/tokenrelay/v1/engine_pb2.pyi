from services.proto.tokenrelay.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EngineRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "eos_token_ids", "cache_salt", "trace_context")
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
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: str
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[str] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

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
    __slots__ = ("backend", "model", "active_requests", "queued_requests", "max_active_requests", "kv_blocks_total", "kv_blocks_used", "tokens_per_block", "max_context", "prompt_tokens_total", "cached_tokens_total", "generated_tokens_total", "draining")
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
    def __init__(self, backend: _Optional[str] = ..., model: _Optional[str] = ..., active_requests: _Optional[int] = ..., queued_requests: _Optional[int] = ..., max_active_requests: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., tokens_per_block: _Optional[int] = ..., max_context: _Optional[int] = ..., prompt_tokens_total: _Optional[int] = ..., cached_tokens_total: _Optional[int] = ..., generated_tokens_total: _Optional[int] = ..., draining: _Optional[bool] = ...) -> None: ...
