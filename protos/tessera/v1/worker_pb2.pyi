from tessera.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerGenerateRequest(_message.Message):
    __slots__ = ("request_id", "base_model", "adapter", "text", "chat", "sampling", "tpot_slo_ms", "ttft_slo_ms", "task_head")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TPOT_SLO_MS_FIELD_NUMBER: _ClassVar[int]
    TTFT_SLO_MS_FIELD_NUMBER: _ClassVar[int]
    TASK_HEAD_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    base_model: str
    adapter: _common_pb2.Adapter
    text: str
    chat: _common_pb2.ChatPrompt
    sampling: _common_pb2.SamplingParams
    tpot_slo_ms: float
    ttft_slo_ms: float
    task_head: bool
    def __init__(self, request_id: _Optional[str] = ..., base_model: _Optional[str] = ..., adapter: _Optional[_Union[_common_pb2.Adapter, _Mapping]] = ..., text: _Optional[str] = ..., chat: _Optional[_Union[_common_pb2.ChatPrompt, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., tpot_slo_ms: _Optional[float] = ..., ttft_slo_ms: _Optional[float] = ..., task_head: _Optional[bool] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WatchStateRequest(_message.Message):
    __slots__ = ("interval_ms",)
    INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    interval_ms: int
    def __init__(self, interval_ms: _Optional[int] = ...) -> None: ...

class LoadEntry(_message.Message):
    __slots__ = ("adapter", "rank", "tokens")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    adapter: str
    rank: int
    tokens: int
    def __init__(self, adapter: _Optional[str] = ..., rank: _Optional[int] = ..., tokens: _Optional[int] = ...) -> None: ...

class WorkerState(_message.Message):
    __slots__ = ("base_model", "perf_model", "running", "queued", "gpu_adapters", "host_adapters", "gpu_adapter_slots", "max_batch", "free_kv_tokens", "loading_adapters", "perf_model_spec", "gpu_victim_rate")
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    PERF_MODEL_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    GPU_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    HOST_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    GPU_ADAPTER_SLOTS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    FREE_KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOADING_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    PERF_MODEL_SPEC_FIELD_NUMBER: _ClassVar[int]
    GPU_VICTIM_RATE_FIELD_NUMBER: _ClassVar[int]
    base_model: str
    perf_model: str
    running: _containers.RepeatedCompositeFieldContainer[LoadEntry]
    queued: _containers.RepeatedCompositeFieldContainer[LoadEntry]
    gpu_adapters: _containers.RepeatedScalarFieldContainer[str]
    host_adapters: _containers.RepeatedScalarFieldContainer[str]
    gpu_adapter_slots: int
    max_batch: int
    free_kv_tokens: int
    loading_adapters: _containers.RepeatedScalarFieldContainer[str]
    perf_model_spec: str
    gpu_victim_rate: float
    def __init__(self, base_model: _Optional[str] = ..., perf_model: _Optional[str] = ..., running: _Optional[_Iterable[_Union[LoadEntry, _Mapping]]] = ..., queued: _Optional[_Iterable[_Union[LoadEntry, _Mapping]]] = ..., gpu_adapters: _Optional[_Iterable[str]] = ..., host_adapters: _Optional[_Iterable[str]] = ..., gpu_adapter_slots: _Optional[int] = ..., max_batch: _Optional[int] = ..., free_kv_tokens: _Optional[int] = ..., loading_adapters: _Optional[_Iterable[str]] = ..., perf_model_spec: _Optional[str] = ..., gpu_victim_rate: _Optional[float] = ...) -> None: ...
