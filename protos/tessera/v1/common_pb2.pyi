from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    TIER_GPU: _ClassVar[Tier]
    TIER_HOST: _ClassVar[Tier]
    TIER_DISK: _ClassVar[Tier]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
TIER_UNSPECIFIED: Tier
TIER_GPU: Tier
TIER_HOST: Tier
TIER_DISK: Tier

class ContentPart(_message.Message):
    __slots__ = ("text", "image", "video")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    VIDEO_FIELD_NUMBER: _ClassVar[int]
    text: str
    image: bytes
    video: VideoPart
    def __init__(self, text: _Optional[str] = ..., image: _Optional[bytes] = ..., video: _Optional[_Union[VideoPart, _Mapping]] = ...) -> None: ...

class VideoPart(_message.Message):
    __slots__ = ("file", "frames", "fps", "max_frames")
    FILE_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    FPS_FIELD_NUMBER: _ClassVar[int]
    MAX_FRAMES_FIELD_NUMBER: _ClassVar[int]
    file: bytes
    frames: VideoFrames
    fps: float
    max_frames: int
    def __init__(self, file: _Optional[bytes] = ..., frames: _Optional[_Union[VideoFrames, _Mapping]] = ..., fps: _Optional[float] = ..., max_frames: _Optional[int] = ...) -> None: ...

class VideoFrames(_message.Message):
    __slots__ = ("images",)
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    images: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, images: _Optional[_Iterable[bytes]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "parts")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    parts: _containers.RepeatedCompositeFieldContainer[ContentPart]
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., parts: _Optional[_Iterable[_Union[ContentPart, _Mapping]]] = ...) -> None: ...

class ChatPrompt(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "max_tokens", "stop", "seed", "logprobs", "stop_token_ids")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    seed: int
    logprobs: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., seed: _Optional[int] = ..., logprobs: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "token", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    token: str
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., token: _Optional[str] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "token", "logprob", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    token: str
    logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., token: _Optional[str] = ..., logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class TokenDelta(_message.Message):
    __slots__ = ("token_ids", "text", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class Completion(_message.Message):
    __slots__ = ("finish_reason", "usage", "text", "head")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    HEAD_FIELD_NUMBER: _ClassVar[int]
    finish_reason: FinishReason
    usage: Usage
    text: str
    head: HeadOutput
    def __init__(self, finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., text: _Optional[str] = ..., head: _Optional[_Union[HeadOutput, _Mapping]] = ...) -> None: ...

class Detection(_message.Message):
    __slots__ = ("label_index", "label", "score", "box")
    LABEL_INDEX_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    BOX_FIELD_NUMBER: _ClassVar[int]
    label_index: int
    label: str
    score: float
    box: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, label_index: _Optional[int] = ..., label: _Optional[str] = ..., score: _Optional[float] = ..., box: _Optional[_Iterable[float]] = ...) -> None: ...

class HeadOutput(_message.Message):
    __slots__ = ("probs", "label_index", "label", "detections")
    PROBS_FIELD_NUMBER: _ClassVar[int]
    LABEL_INDEX_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    DETECTIONS_FIELD_NUMBER: _ClassVar[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    label_index: int
    label: str
    detections: _containers.RepeatedCompositeFieldContainer[Detection]
    def __init__(self, probs: _Optional[_Iterable[float]] = ..., label_index: _Optional[int] = ..., label: _Optional[str] = ..., detections: _Optional[_Iterable[_Union[Detection, _Mapping]]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "delta", "final")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    delta: TokenDelta
    final: Completion
    def __init__(self, request_id: _Optional[str] = ..., delta: _Optional[_Union[TokenDelta, _Mapping]] = ..., final: _Optional[_Union[Completion, _Mapping]] = ...) -> None: ...

class BaseModel(_message.Message):
    __slots__ = ("name", "architecture", "path", "max_context", "vocab_size", "created_unix")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    name: str
    architecture: str
    path: str
    max_context: int
    vocab_size: int
    created_unix: int
    def __init__(self, name: _Optional[str] = ..., architecture: _Optional[str] = ..., path: _Optional[str] = ..., max_context: _Optional[int] = ..., vocab_size: _Optional[int] = ..., created_unix: _Optional[int] = ...) -> None: ...

class Adapter(_message.Message):
    __slots__ = ("name", "base_model", "rank", "alpha", "target_modules", "size_bytes", "sha256", "storage_path", "created_unix", "task_head_json", "tpot_slo_ms", "ttft_slo_ms", "created_unix_ms", "tower_lora_params", "tasks")
    NAME_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    STORAGE_PATH_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    TASK_HEAD_JSON_FIELD_NUMBER: _ClassVar[int]
    TPOT_SLO_MS_FIELD_NUMBER: _ClassVar[int]
    TTFT_SLO_MS_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    TOWER_LORA_PARAMS_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    name: str
    base_model: str
    rank: int
    alpha: float
    target_modules: _containers.RepeatedScalarFieldContainer[str]
    size_bytes: int
    sha256: str
    storage_path: str
    created_unix: int
    task_head_json: str
    tpot_slo_ms: float
    ttft_slo_ms: float
    created_unix_ms: int
    tower_lora_params: int
    tasks: _containers.RepeatedCompositeFieldContainer[AdapterTask]
    def __init__(self, name: _Optional[str] = ..., base_model: _Optional[str] = ..., rank: _Optional[int] = ..., alpha: _Optional[float] = ..., target_modules: _Optional[_Iterable[str]] = ..., size_bytes: _Optional[int] = ..., sha256: _Optional[str] = ..., storage_path: _Optional[str] = ..., created_unix: _Optional[int] = ..., task_head_json: _Optional[str] = ..., tpot_slo_ms: _Optional[float] = ..., ttft_slo_ms: _Optional[float] = ..., created_unix_ms: _Optional[int] = ..., tower_lora_params: _Optional[int] = ..., tasks: _Optional[_Iterable[_Union[AdapterTask, _Mapping]]] = ...) -> None: ...

class AdapterTask(_message.Message):
    __slots__ = ("name", "accuracy", "metric")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ACCURACY_FIELD_NUMBER: _ClassVar[int]
    METRIC_FIELD_NUMBER: _ClassVar[int]
    name: str
    accuracy: float
    metric: str
    def __init__(self, name: _Optional[str] = ..., accuracy: _Optional[float] = ..., metric: _Optional[str] = ...) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("running_requests", "waiting_requests", "running_ranks", "resident_adapters", "free_kv_tokens", "adapter_slots", "generated_tokens_total", "prefix_cache_hit_tokens_total", "prefix_cache_query_tokens_total", "prefix_cache_blocks", "prefix_cache_evicted_blocks_total", "image_cache_hits_total", "image_cache_misses_total", "image_cache_evictions_total", "image_cache_entries", "image_cache_bytes", "image_cache_capacity_bytes", "adapter_gpu_bytes", "adapter_host_bytes", "adapter_requests_total", "busy_seconds_total")
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_RANKS_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    FREE_KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_SLOTS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERY_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_EVICTED_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    IMAGE_CACHE_HITS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    IMAGE_CACHE_MISSES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    IMAGE_CACHE_EVICTIONS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    IMAGE_CACHE_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    IMAGE_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    IMAGE_CACHE_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_GPU_BYTES_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_HOST_BYTES_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_REQUESTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    BUSY_SECONDS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    running_requests: int
    waiting_requests: int
    running_ranks: _containers.RepeatedScalarFieldContainer[int]
    resident_adapters: _containers.RepeatedScalarFieldContainer[str]
    free_kv_tokens: int
    adapter_slots: int
    generated_tokens_total: int
    prefix_cache_hit_tokens_total: int
    prefix_cache_query_tokens_total: int
    prefix_cache_blocks: int
    prefix_cache_evicted_blocks_total: int
    image_cache_hits_total: int
    image_cache_misses_total: int
    image_cache_evictions_total: int
    image_cache_entries: int
    image_cache_bytes: int
    image_cache_capacity_bytes: int
    adapter_gpu_bytes: int
    adapter_host_bytes: int
    adapter_requests_total: _containers.RepeatedCompositeFieldContainer[AdapterRequests]
    busy_seconds_total: float
    def __init__(self, running_requests: _Optional[int] = ..., waiting_requests: _Optional[int] = ..., running_ranks: _Optional[_Iterable[int]] = ..., resident_adapters: _Optional[_Iterable[str]] = ..., free_kv_tokens: _Optional[int] = ..., adapter_slots: _Optional[int] = ..., generated_tokens_total: _Optional[int] = ..., prefix_cache_hit_tokens_total: _Optional[int] = ..., prefix_cache_query_tokens_total: _Optional[int] = ..., prefix_cache_blocks: _Optional[int] = ..., prefix_cache_evicted_blocks_total: _Optional[int] = ..., image_cache_hits_total: _Optional[int] = ..., image_cache_misses_total: _Optional[int] = ..., image_cache_evictions_total: _Optional[int] = ..., image_cache_entries: _Optional[int] = ..., image_cache_bytes: _Optional[int] = ..., image_cache_capacity_bytes: _Optional[int] = ..., adapter_gpu_bytes: _Optional[int] = ..., adapter_host_bytes: _Optional[int] = ..., adapter_requests_total: _Optional[_Iterable[_Union[AdapterRequests, _Mapping]]] = ..., busy_seconds_total: _Optional[float] = ...) -> None: ...

class AdapterRequests(_message.Message):
    __slots__ = ("adapter", "requests")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    adapter: str
    requests: int
    def __init__(self, adapter: _Optional[str] = ..., requests: _Optional[int] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "address", "device", "base_model", "capacity", "last_heartbeat_unix_ms", "healthy", "stats")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    device: str
    base_model: str
    capacity: int
    last_heartbeat_unix_ms: int
    healthy: bool
    stats: WorkerStats
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., device: _Optional[str] = ..., base_model: _Optional[str] = ..., capacity: _Optional[int] = ..., last_heartbeat_unix_ms: _Optional[int] = ..., healthy: _Optional[bool] = ..., stats: _Optional[_Union[WorkerStats, _Mapping]] = ...) -> None: ...

class Placement(_message.Message):
    __slots__ = ("adapter", "worker_id", "tier", "updated_unix_ms", "loading", "pinned")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    UPDATED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    LOADING_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    adapter: str
    worker_id: str
    tier: Tier
    updated_unix_ms: int
    loading: bool
    pinned: bool
    def __init__(self, adapter: _Optional[str] = ..., worker_id: _Optional[str] = ..., tier: _Optional[_Union[Tier, str]] = ..., updated_unix_ms: _Optional[int] = ..., loading: _Optional[bool] = ..., pinned: _Optional[bool] = ...) -> None: ...
