from services.proto.tokenrelay.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TokenizeInput(_message.Message):
    __slots__ = ("text", "chat", "add_special_tokens", "allow_special_tokens")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ALLOW_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    text: str
    chat: ChatMessages
    add_special_tokens: bool
    allow_special_tokens: bool
    def __init__(self, text: _Optional[str] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., add_special_tokens: _Optional[bool] = ..., allow_special_tokens: _Optional[bool] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages", "add_generation_prompt", "cache_key")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    CACHE_KEY_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[_common_pb2.ChatMessage]
    add_generation_prompt: bool
    cache_key: str
    def __init__(self, messages: _Optional[_Iterable[_Union[_common_pb2.ChatMessage, _Mapping]]] = ..., add_generation_prompt: _Optional[bool] = ..., cache_key: _Optional[str] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("inputs", "packed_ids")
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    PACKED_IDS_FIELD_NUMBER: _ClassVar[int]
    inputs: _containers.RepeatedCompositeFieldContainer[TokenizeInput]
    packed_ids: bool
    def __init__(self, inputs: _Optional[_Iterable[_Union[TokenizeInput, _Mapping]]] = ..., packed_ids: _Optional[bool] = ...) -> None: ...

class TokenizeResult(_message.Message):
    __slots__ = ("ids", "packed_ids")
    IDS_FIELD_NUMBER: _ClassVar[int]
    PACKED_IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    packed_ids: bytes
    def __init__(self, ids: _Optional[_Iterable[int]] = ..., packed_ids: _Optional[bytes] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[TokenizeResult]
    def __init__(self, results: _Optional[_Iterable[_Union[TokenizeResult, _Mapping]]] = ...) -> None: ...

class DetokOpen(_message.Message):
    __slots__ = ("request_id", "stop", "include_stop_str", "skip_special_tokens", "prefix_ids", "trace_context")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_IDS_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    stop: _containers.RepeatedScalarFieldContainer[str]
    include_stop_str: bool
    skip_special_tokens: bool
    prefix_ids: _containers.RepeatedScalarFieldContainer[int]
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, request_id: _Optional[str] = ..., stop: _Optional[_Iterable[str]] = ..., include_stop_str: _Optional[bool] = ..., skip_special_tokens: _Optional[bool] = ..., prefix_ids: _Optional[_Iterable[int]] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class DetokTokens(_message.Message):
    __slots__ = ("request_id", "token_ids", "final")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    final: bool
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., final: _Optional[bool] = ...) -> None: ...

class DetokClose(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class DetokenizeRequest(_message.Message):
    __slots__ = ("open", "tokens", "close")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    open: _containers.RepeatedCompositeFieldContainer[DetokOpen]
    tokens: _containers.RepeatedCompositeFieldContainer[DetokTokens]
    close: _containers.RepeatedCompositeFieldContainer[DetokClose]
    def __init__(self, open: _Optional[_Iterable[_Union[DetokOpen, _Mapping]]] = ..., tokens: _Optional[_Iterable[_Union[DetokTokens, _Mapping]]] = ..., close: _Optional[_Iterable[_Union[DetokClose, _Mapping]]] = ...) -> None: ...

class DetokOutput(_message.Message):
    __slots__ = ("request_id", "text", "finished", "matched_stop", "tokens_consumed", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    MATCHED_STOP_FIELD_NUMBER: _ClassVar[int]
    TOKENS_CONSUMED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    finished: bool
    matched_stop: str
    tokens_consumed: int
    error: str
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., finished: _Optional[bool] = ..., matched_stop: _Optional[str] = ..., tokens_consumed: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class DetokenizeResponse(_message.Message):
    __slots__ = ("outputs",)
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[DetokOutput]
    def __init__(self, outputs: _Optional[_Iterable[_Union[DetokOutput, _Mapping]]] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TokenizerInfo(_message.Message):
    __slots__ = ("name", "vocab_size", "eos_token_ids", "bos_token_id", "max_context", "has_chat_template", "special_token_ids")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    HAS_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    SPECIAL_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    name: str
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bos_token_id: int
    max_context: int
    has_chat_template: bool
    special_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., bos_token_id: _Optional[int] = ..., max_context: _Optional[int] = ..., has_chat_template: _Optional[bool] = ..., special_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...
