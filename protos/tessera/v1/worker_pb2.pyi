from tessera.v1 import common_pb2 as _common_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerGenerateRequest(_message.Message):
    __slots__ = ("request_id", "base_model", "adapter", "text", "chat", "sampling")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    base_model: str
    adapter: _common_pb2.Adapter
    text: str
    chat: _common_pb2.ChatPrompt
    sampling: _common_pb2.SamplingParams
    def __init__(self, request_id: _Optional[str] = ..., base_model: _Optional[str] = ..., adapter: _Optional[_Union[_common_pb2.Adapter, _Mapping]] = ..., text: _Optional[str] = ..., chat: _Optional[_Union[_common_pb2.ChatPrompt, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
