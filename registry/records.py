"""The registry's domain records: plain frozen dataclasses, never ORM rows.

Every API of `RegistryStore` returns these, so callers (admin API, gRPC
service) never hold a database session or a lazily-loaded attribute.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any

# The LoRA-targetable projections of a Llama-family decoder layer, in layer order.
SUPPORTED_TARGET_MODULES: tuple[str, ...] = (
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class Tier(str, enum.Enum):
    """Where an adapter's weights sit on a worker (ROCK's tiers), fastest first."""

    GPU = "gpu"
    HOST = "host"
    DISK = "disk"


@dataclasses.dataclass(frozen=True, slots=True)
class ModuleShape:
    """A projection's weight is [out_features, in_features]; its LoRA A is [r, in], B is [out, r]."""

    in_features: int
    out_features: int


@dataclasses.dataclass(frozen=True, slots=True)
class BaseModelRecord:
    name: str
    architecture: str
    path: str
    max_context: int
    vocab_size: int
    hidden_size: int
    num_layers: int
    module_shapes: dict[str, ModuleShape]  # projection name -> shape, for every SUPPORTED_TARGET_MODULES
    created_unix_ms: int


# The metrics `tessera fuse` measures a task's accuracy with (docs/fuse.md).
TASK_METRICS: tuple[str, ...] = ("exact_match", "accuracy", "map50")


@dataclasses.dataclass(frozen=True, slots=True)
class AdapterTask:
    """A task an adapter serves: requests name it as "task:<name>" (docs/fuse.md, "Routing by task")."""

    name: str        # [a-z0-9][a-z0-9-]{0,62}, unique within the adapter
    accuracy: float  # in [0, 1], measured on the task's eval set
    metric: str      # one of TASK_METRICS


@dataclasses.dataclass(frozen=True, slots=True)
class AdapterRecord:
    name: str
    base_model: str
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    size_bytes: int
    sha256: str  # content digest of adapter_config.json and adapter_model.safetensors (adapter_layout.content_digest)
    storage_path: str  # <adapter_store>/<sha256> (rows from before migration 0002: the weights' sha256)
    created_unix_ms: int
    task_head: dict[str, Any] | None
    tpot_slo_ms: float | None = None  # its default objectives for requests that name none; None: the gateway's
    ttft_slo_ms: float | None = None
    tower_lora_params: int = 0  # its LoRA parameters on the vision tower and projector (tower_lora.py)
    tasks: tuple[AdapterTask, ...] = ()  # the tasks it serves (registration names them), in the order given


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerRecord:
    worker_id: str
    address: str
    device: str
    base_model: str
    capacity: int
    last_heartbeat_unix_ms: int
    healthy: bool  # heartbeat within the store's worker_timeout_s, judged when read
    stats: dict[str, Any]


@dataclasses.dataclass(frozen=True, slots=True)
class PlacementRecord:
    """Where a worker reports an adapter (the version its new requests get)."""

    adapter: str
    worker_id: str
    tier: Tier
    updated_unix_ms: int
    loading: bool = False  # on its way to the GPU (from `tier`)
    pinned: bool = False   # pinned there by an operator's order


@dataclasses.dataclass(frozen=True, slots=True)
class ReportedPlacement:
    """One entry of a worker's placement report."""

    adapter: str
    tier: Tier
    loading: bool = False
    pinned: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class PlacementOrderRecord:
    """An operator's order: hold `adapter` on a worker (or on every worker of its base model) without
    waiting for a request. `pin`: never evicted while the order stands; else preloaded once."""

    adapter: str
    worker_address: str | None  # None: every worker serving the adapter's base model, now or later
    pin: bool
    created_unix_ms: int


# (adapter name, content digest): one version of an adapter as a worker holds it.
AdapterVersion = tuple[str, str]


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerOrders:
    """What the registry asks of one worker's adapter tiers (answered to each heartbeat)."""

    retire: tuple[AdapterVersion, ...]  # held versions no adapter is anymore: drop once their requests end
    placements: tuple[tuple[AdapterRecord, bool], ...]  # (adapter, pin) for every order that reaches it
    host_placements: tuple[AdapterRecord, ...] = ()  # the planner's warm adapters: into host memory only
    planned_rates: Mapping[str, float] = dataclasses.field(default_factory=dict)  # the planner's adapters ->
    # the requests/s it expects the worker to serve of each


@dataclasses.dataclass(frozen=True, slots=True)
class PlannedPlacementRecord:
    """The placement planner's decision: hold `adapter` on `worker_address`'s GPU ("gpu") or in its host
    memory ("host"), where the plan expects `rate` requests/s of it (its share of the adapter's requests)."""

    adapter: str
    worker_address: str
    tier: str
    rate: float
    planned_unix_ms: int


@dataclasses.dataclass(frozen=True, slots=True)
class PlacementInputs:
    """What the planner plans one base model's placement from (RegistryStore.placement_inputs)."""

    workers: tuple[WorkerRecord, ...]       # healthy ones; their stats carry tier budgets and request counts
    sizes: dict[str, int]                   # adapter -> bytes
    on_gpu: dict[str, frozenset[str]]       # adapter -> addresses of the workers reporting it on their GPU
    in_host: dict[str, frozenset[str]]      # ... in their host memory only


@dataclasses.dataclass(frozen=True, slots=True)
class CatalogChange:
    """A committed change to the adapters or base models (the gateways' caches follow these)."""

    removed_adapters: tuple[str, ...] = ()
