from services.proto.tokenrelay.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Messages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[_common_pb2.ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[_common_pb2.ChatMessage, _Mapping]]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "messages", "token_ids", "sampling", "priority", "session_id", "return_token_ids", "request_id", "model", "min_delta_tokens", "min_delta_interval_ms")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    RETURN_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MIN_DELTA_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_DELTA_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    messages: Messages
    token_ids: TokenIds
    sampling: _common_pb2.SamplingParams
    priority: _common_pb2.Priority
    session_id: str
    return_token_ids: bool
    request_id: str
    model: str
    min_delta_tokens: int
    min_delta_interval_ms: int
    def __init__(self, prompt: _Optional[str] = ..., messages: _Optional[_Union[Messages, _Mapping]] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., priority: _Optional[_Union[_common_pb2.Priority, str]] = ..., session_id: _Optional[str] = ..., return_token_ids: _Optional[bool] = ..., request_id: _Optional[str] = ..., model: _Optional[str] = ..., min_delta_tokens: _Optional[int] = ..., min_delta_interval_ms: _Optional[int] = ...) -> None: ...

class Accepted(_message.Message):
    __slots__ = ("request_id", "prompt_tokens", "queue_position")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_POSITION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_tokens: int
    queue_position: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., queue_position: _Optional[int] = ...) -> None: ...

class Delta(_message.Message):
    __slots__ = ("text", "token_ids")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Done(_message.Message):
    __slots__ = ("finish_reason", "usage", "timings", "stop_reason")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    finish_reason: _common_pb2.FinishReason
    usage: _common_pb2.Usage
    timings: _common_pb2.Timings
    stop_reason: str
    def __init__(self, finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., timings: _Optional[_Union[_common_pb2.Timings, _Mapping]] = ..., stop_reason: _Optional[str] = ...) -> None: ...

class Migrated(_message.Message):
    __slots__ = ("migrations", "tokens_so_far", "reason")
    MIGRATIONS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_SO_FAR_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    migrations: int
    tokens_so_far: int
    reason: str
    def __init__(self, migrations: _Optional[int] = ..., tokens_so_far: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("accepted", "delta", "done", "migrated")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    MIGRATED_FIELD_NUMBER: _ClassVar[int]
    accepted: Accepted
    delta: Delta
    done: Done
    migrated: Migrated
    def __init__(self, accepted: _Optional[_Union[Accepted, _Mapping]] = ..., delta: _Optional[_Union[Delta, _Mapping]] = ..., done: _Optional[_Union[Done, _Mapping]] = ..., migrated: _Optional[_Union[Migrated, _Mapping]] = ...) -> None: ...

class ChatTurn(_message.Message):
    __slots__ = ("messages", "sampling", "min_delta_tokens", "min_delta_interval_ms")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MIN_DELTA_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_DELTA_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[_common_pb2.ChatMessage]
    sampling: _common_pb2.SamplingParams
    min_delta_tokens: int
    min_delta_interval_ms: int
    def __init__(self, messages: _Optional[_Iterable[_Union[_common_pb2.ChatMessage, _Mapping]]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., min_delta_tokens: _Optional[int] = ..., min_delta_interval_ms: _Optional[int] = ...) -> None: ...

class ChatRequest(_message.Message):
    __slots__ = ("start", "turn", "cancel")
    START_FIELD_NUMBER: _ClassVar[int]
    TURN_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    start: ChatStart
    turn: ChatTurn
    cancel: ChatCancel
    def __init__(self, start: _Optional[_Union[ChatStart, _Mapping]] = ..., turn: _Optional[_Union[ChatTurn, _Mapping]] = ..., cancel: _Optional[_Union[ChatCancel, _Mapping]] = ...) -> None: ...

class ChatStart(_message.Message):
    __slots__ = ("session_id", "system", "priority", "return_token_ids")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SYSTEM_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    RETURN_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    system: _containers.RepeatedCompositeFieldContainer[_common_pb2.ChatMessage]
    priority: _common_pb2.Priority
    return_token_ids: bool
    def __init__(self, session_id: _Optional[str] = ..., system: _Optional[_Iterable[_Union[_common_pb2.ChatMessage, _Mapping]]] = ..., priority: _Optional[_Union[_common_pb2.Priority, str]] = ..., return_token_ids: _Optional[bool] = ...) -> None: ...

class ChatCancel(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ChatResponse(_message.Message):
    __slots__ = ("started", "accepted", "delta", "done", "turn_error", "migrated")
    STARTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    TURN_ERROR_FIELD_NUMBER: _ClassVar[int]
    MIGRATED_FIELD_NUMBER: _ClassVar[int]
    started: ChatStarted
    accepted: Accepted
    delta: Delta
    done: Done
    turn_error: TurnError
    migrated: Migrated
    def __init__(self, started: _Optional[_Union[ChatStarted, _Mapping]] = ..., accepted: _Optional[_Union[Accepted, _Mapping]] = ..., delta: _Optional[_Union[Delta, _Mapping]] = ..., done: _Optional[_Union[Done, _Mapping]] = ..., turn_error: _Optional[_Union[TurnError, _Mapping]] = ..., migrated: _Optional[_Union[Migrated, _Mapping]] = ...) -> None: ...

class TurnError(_message.Message):
    __slots__ = ("code", "reason", "message", "retry_after_ms", "request_id")
    CODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_MS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    code: str
    reason: str
    message: str
    retry_after_ms: int
    request_id: str
    def __init__(self, code: _Optional[str] = ..., reason: _Optional[str] = ..., message: _Optional[str] = ..., retry_after_ms: _Optional[int] = ..., request_id: _Optional[str] = ...) -> None: ...

class ChatStarted(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class CancelResponse(_message.Message):
    __slots__ = ("cancelled",)
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    cancelled: bool
    def __init__(self, cancelled: _Optional[bool] = ...) -> None: ...

class StreamSubmit(_message.Message):
    __slots__ = ("request", "timeout_ms")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    request: GenerateRequest
    timeout_ms: int
    def __init__(self, request: _Optional[_Union[GenerateRequest, _Mapping]] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class StreamRequest(_message.Message):
    __slots__ = ("submit", "cancel")
    SUBMIT_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    submit: _containers.RepeatedCompositeFieldContainer[StreamSubmit]
    cancel: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, submit: _Optional[_Iterable[_Union[StreamSubmit, _Mapping]]] = ..., cancel: _Optional[_Iterable[str]] = ...) -> None: ...

class StreamEvent(_message.Message):
    __slots__ = ("request_id", "accepted", "delta", "done", "migrated", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    MIGRATED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    accepted: Accepted
    delta: Delta
    done: Done
    migrated: Migrated
    error: TurnError
    def __init__(self, request_id: _Optional[str] = ..., accepted: _Optional[_Union[Accepted, _Mapping]] = ..., delta: _Optional[_Union[Delta, _Mapping]] = ..., done: _Optional[_Union[Done, _Mapping]] = ..., migrated: _Optional[_Union[Migrated, _Mapping]] = ..., error: _Optional[_Union[TurnError, _Mapping]] = ...) -> None: ...

class StreamResponse(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[StreamEvent]
    def __init__(self, events: _Optional[_Iterable[_Union[StreamEvent, _Mapping]]] = ...) -> None: ...
