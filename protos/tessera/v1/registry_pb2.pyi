from tessera.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetBaseModelRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class ListBaseModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListBaseModelsResponse(_message.Message):
    __slots__ = ("base_models",)
    BASE_MODELS_FIELD_NUMBER: _ClassVar[int]
    base_models: _containers.RepeatedCompositeFieldContainer[_common_pb2.BaseModel]
    def __init__(self, base_models: _Optional[_Iterable[_Union[_common_pb2.BaseModel, _Mapping]]] = ...) -> None: ...

class GetAdapterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class ListAdaptersRequest(_message.Message):
    __slots__ = ("base_model",)
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    base_model: str
    def __init__(self, base_model: _Optional[str] = ...) -> None: ...

class ListAdaptersResponse(_message.Message):
    __slots__ = ("adapters",)
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[_common_pb2.Adapter]
    def __init__(self, adapters: _Optional[_Iterable[_Union[_common_pb2.Adapter, _Mapping]]] = ...) -> None: ...

class RegisterWorkerRequest(_message.Message):
    __slots__ = ("address", "device", "base_model", "capacity")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    address: str
    device: str
    base_model: str
    capacity: int
    def __init__(self, address: _Optional[str] = ..., device: _Optional[str] = ..., base_model: _Optional[str] = ..., capacity: _Optional[int] = ...) -> None: ...

class RegisterWorkerResponse(_message.Message):
    __slots__ = ("worker_id", "heartbeat_interval_ms")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    heartbeat_interval_ms: int
    def __init__(self, worker_id: _Optional[str] = ..., heartbeat_interval_ms: _Optional[int] = ...) -> None: ...

class AdapterVersion(_message.Message):
    __slots__ = ("name", "sha256")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    name: str
    sha256: str
    def __init__(self, name: _Optional[str] = ..., sha256: _Optional[str] = ...) -> None: ...

class PlacementOrder(_message.Message):
    __slots__ = ("adapter", "pin", "host_only", "expected_rate")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    PIN_FIELD_NUMBER: _ClassVar[int]
    HOST_ONLY_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_RATE_FIELD_NUMBER: _ClassVar[int]
    adapter: _common_pb2.Adapter
    pin: bool
    host_only: bool
    expected_rate: float
    def __init__(self, adapter: _Optional[_Union[_common_pb2.Adapter, _Mapping]] = ..., pin: _Optional[bool] = ..., host_only: _Optional[bool] = ..., expected_rate: _Optional[float] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker_id", "stats", "adapters")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    stats: _common_pb2.WorkerStats
    adapters: _containers.RepeatedCompositeFieldContainer[AdapterVersion]
    def __init__(self, worker_id: _Optional[str] = ..., stats: _Optional[_Union[_common_pb2.WorkerStats, _Mapping]] = ..., adapters: _Optional[_Iterable[_Union[AdapterVersion, _Mapping]]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("known", "retire", "placements")
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    RETIRE_FIELD_NUMBER: _ClassVar[int]
    PLACEMENTS_FIELD_NUMBER: _ClassVar[int]
    known: bool
    retire: _containers.RepeatedCompositeFieldContainer[AdapterVersion]
    placements: _containers.RepeatedCompositeFieldContainer[PlacementOrder]
    def __init__(self, known: _Optional[bool] = ..., retire: _Optional[_Iterable[_Union[AdapterVersion, _Mapping]]] = ..., placements: _Optional[_Iterable[_Union[PlacementOrder, _Mapping]]] = ...) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ("base_model", "healthy_only")
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_ONLY_FIELD_NUMBER: _ClassVar[int]
    base_model: str
    healthy_only: bool
    def __init__(self, base_model: _Optional[str] = ..., healthy_only: _Optional[bool] = ...) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[_common_pb2.WorkerInfo]
    def __init__(self, workers: _Optional[_Iterable[_Union[_common_pb2.WorkerInfo, _Mapping]]] = ...) -> None: ...

class ReportPlacementsRequest(_message.Message):
    __slots__ = ("worker_id", "placements")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PLACEMENTS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    placements: _containers.RepeatedCompositeFieldContainer[_common_pb2.Placement]
    def __init__(self, worker_id: _Optional[str] = ..., placements: _Optional[_Iterable[_Union[_common_pb2.Placement, _Mapping]]] = ...) -> None: ...

class ReportPlacementsResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListPlacementsRequest(_message.Message):
    __slots__ = ("adapter", "worker_id")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    adapter: str
    worker_id: str
    def __init__(self, adapter: _Optional[str] = ..., worker_id: _Optional[str] = ...) -> None: ...

class ListPlacementsResponse(_message.Message):
    __slots__ = ("placements",)
    PLACEMENTS_FIELD_NUMBER: _ClassVar[int]
    placements: _containers.RepeatedCompositeFieldContainer[_common_pb2.Placement]
    def __init__(self, placements: _Optional[_Iterable[_Union[_common_pb2.Placement, _Mapping]]] = ...) -> None: ...

class WatchCatalogRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CatalogChange(_message.Message):
    __slots__ = ("removed_adapters",)
    REMOVED_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    removed_adapters: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, removed_adapters: _Optional[_Iterable[str]] = ...) -> None: ...
