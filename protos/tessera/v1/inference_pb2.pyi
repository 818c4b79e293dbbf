from tessera.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("model", "text", "chat", "sampling", "request_id", "slo")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SLO_FIELD_NUMBER: _ClassVar[int]
    model: str
    text: str
    chat: _common_pb2.ChatPrompt
    sampling: _common_pb2.SamplingParams
    request_id: str
    slo: Slo
    def __init__(self, model: _Optional[str] = ..., text: _Optional[str] = ..., chat: _Optional[_Union[_common_pb2.ChatPrompt, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., request_id: _Optional[str] = ..., slo: _Optional[_Union[Slo, _Mapping]] = ...) -> None: ...

class Slo(_message.Message):
    __slots__ = ("tpot_ms", "ttft_ms")
    TPOT_MS_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    tpot_ms: float
    ttft_ms: float
    def __init__(self, tpot_ms: _Optional[float] = ..., ttft_ms: _Optional[float] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelCard(_message.Message):
    __slots__ = ("id", "base_model", "is_adapter", "rank", "created_unix", "parent")
    ID_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    IS_ADAPTER_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    id: str
    base_model: str
    is_adapter: bool
    rank: int
    created_unix: int
    parent: str
    def __init__(self, id: _Optional[str] = ..., base_model: _Optional[str] = ..., is_adapter: _Optional[bool] = ..., rank: _Optional[int] = ..., created_unix: _Optional[int] = ..., parent: _Optional[str] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelCard]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelCard, _Mapping]]] = ...) -> None: ...

class ClassifyRequest(_message.Message):
    __slots__ = ("model", "inputs", "request_id", "slo")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SLO_FIELD_NUMBER: _ClassVar[int]
    model: str
    inputs: _containers.RepeatedCompositeFieldContainer[ClassifyInput]
    request_id: str
    slo: Slo
    def __init__(self, model: _Optional[str] = ..., inputs: _Optional[_Iterable[_Union[ClassifyInput, _Mapping]]] = ..., request_id: _Optional[str] = ..., slo: _Optional[_Union[Slo, _Mapping]] = ...) -> None: ...

class ClassifyInput(_message.Message):
    __slots__ = ("text", "chat")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    text: str
    chat: _common_pb2.ChatPrompt
    def __init__(self, text: _Optional[str] = ..., chat: _Optional[_Union[_common_pb2.ChatPrompt, _Mapping]] = ...) -> None: ...

class ClassifyResponse(_message.Message):
    __slots__ = ("request_id", "results", "usage")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    results: _containers.RepeatedCompositeFieldContainer[_common_pb2.HeadOutput]
    usage: _common_pb2.Usage
    def __init__(self, request_id: _Optional[str] = ..., results: _Optional[_Iterable[_Union[_common_pb2.HeadOutput, _Mapping]]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ...) -> None: ...
