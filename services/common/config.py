"""One configuration for every role: dataclass defaults, one YAML file, env overrides.

Precedence (later wins): the defaults below, the YAML file (``--config`` or
``TESSERA_CONFIG``), then environment variables named ``TESSERA_<SECTION>__<KEY>``
(``TESSERA_GATEWAY__HTTP_PORT=9000``) or ``TESSERA_<KEY>`` for top-level keys
(``TESSERA_HOME=/data``). Env values are parsed as YAML scalars/lists, so
``TESSERA_REGISTRY__IMPORT_ROOTS='[/a, /b]'`` works. Unknown keys and wrong
types are errors: a typo never silently falls back to a default.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from pathlib import Path
from typing import Any, Mapping

import yaml

ENV_PREFIX = "TESSERA_"


class ConfigError(ValueError):
    """The configuration is invalid; the message names the offending key."""


@dataclasses.dataclass(slots=True)
class RegistryConfig:
    host: str = "127.0.0.1"
    grpc_port: int = 50051
    admin_port: int = 8081
    metrics_port: int = 9101
    database_url: str = ""  # "" -> sqlite:///{home}/registry.db; any SQLAlchemy URL works
    adapter_store: str = ""  # "" -> {home}/adapters (content-addressed by sha256)
    # Directories that adapters and base models may be registered from. "" entries
    # are not allowed; an empty list means [{home}].
    import_roots: list[str] = dataclasses.field(default_factory=list)
    admin_api_key: str = ""  # "" -> read or create {home}/admin_api_key (mode 0600)
    worker_timeout_s: float = 10.0  # a worker silent this long is unhealthy
    worker_expiry_s: float = 3600.0  # a worker silent this long is forgotten (gone from /admin/v1/workers)
    heartbeat_interval_ms: int = 1000
    http_threads: int = 8
    # A deleted adapter's stored files stay this long (then a sweep removes them): requests that a
    # worker took before the DELETE may still have to read them.
    deleted_files_grace_s: float = 600.0
    # ROCK's placement (registry/placement_planner.py): every placement_interval_s (0: never), adapters are
    # placed by popularity (requests/s with this half-life): the hot ones' replicas on workers' GPUs (times
    # placement_replica_factor their traffic share of the workers' busy time), warm ones in host memory, the rest on
    # disk, within these shares of each worker's GPU and host adapter tiers.
    placement_interval_s: float = 30.0
    placement_half_life_s: float = 60.0
    placement_gpu_share: float = 0.9
    placement_host_share: float = 0.5
    placement_replica_factor: float = 20.0


@dataclasses.dataclass(slots=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    http_port: int = 8080
    grpc_port: int = 50052
    metrics_port: int = 9102
    registry_address: str = "127.0.0.1:50051"
    metadata_refresh_s: float = 2.0  # how often the registry cache refreshes
    max_tokens_limit: int = 4096  # larger max_tokens is a 400
    default_max_tokens: int = 256
    max_prompt_chars: int = 1_000_000
    # Images in chat messages (docs/images.md), checked before a request reaches a worker.
    max_image_bytes: int = 8 * 1024 * 1024  # one encoded image; larger is a 413
    max_images_per_request: int = 16  # a video's frames count one each
    max_image_pixels: int = 4096 * 4096  # width * height of one image
    # Remote http(s) image URLs (REST only): off, they are refused; on, the gateway downloads them
    # itself (gateway/remote_images.py), within max_image_bytes, and checks them like inline images.
    remote_images: bool = False
    # Hosts it may download from: "cdn.example.com", "*.example.com" (its subdomains); empty: any host.
    remote_image_hosts: list[str] = dataclasses.field(default_factory=list)
    # Hosts resolving to loopback, private, link-local or other non-public addresses are refused
    # (server-side request forgery) unless this is on.
    remote_image_allow_private: bool = False
    remote_image_timeout_s: float = 10.0  # one download: name lookup, connect, redirects and body
    remote_image_max_redirects: int = 3  # each target re-checked (scheme, hosts, addresses)
    request_timeout_s: float = 600.0
    http_threads: int = 32
    # Client API keys for the REST API (Authorization: Bearer <key>); empty: open.
    api_keys: list[str] = dataclasses.field(default_factory=list)
    # Routing (docs/routing.md): the policy, the perf models it prices workers with, and the state
    # workers push. tessera | most-idle | round-robin | random | first-fit | least-loaded-lru
    routing_policy: str = "tessera"
    perf_models_dir: str = ""  # "" -> the repo's policy/perf_models (<kind>.json per worker kind)
    state_interval_ms: int = 50  # how often each worker pushes its state (10..100)
    state_stale_s: float = 1.0  # a worker whose last push is older is out of rotation
    # A request finding no worker with a fresh state, while the registry lists one whose state stream is open
    # but silent (its process paused, or this gateway's loop behind a burst), waits for that stream's next
    # state as long as the registry keeps listing the worker, and at most this long (the registry itself down).
    late_worker_wait_s: float = 30.0
    default_tpot_slo_ms: float = 200.0  # SLO of a request that names none and whose adapter has no default
    default_ttft_slo_ms: float = 5000.0
    # Admission: requests in flight per base model at this gateway; beyond it, 429 / RESOURCE_EXHAUSTED.
    max_queued_per_model: int = 256


@dataclasses.dataclass(slots=True)
class WorkerConfig:
    host: str = "127.0.0.1"
    grpc_port: int = 50061
    metrics_port: int = 9103
    registry_address: str = "127.0.0.1:50051"
    advertise_address: str = ""  # "" -> host:grpc_port
    base_model: str = "tessera-demo-llama"
    device: str = "cpu"  # "cpu", "cuda", "cuda:1"
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    max_num_seqs: int = 32
    max_batch_tokens: int = 4096  # tokens per forward pass; longer prompts are prefilled in chunks
    # Adapter tiers (gpu_worker/lora/adapter_manager.py). The GPU tier, in bytes: adapters packed by their
    # true size (a rank-8 adapter takes 1/8 of a rank-64 one), reserved before the KV cache is sized.
    # 0: room for adapter_slots adapters of max_lora_rank on every lora_target.
    adapter_gpu_bytes: int = 0
    adapter_slots: int = 8
    # The host tier, in bytes (page-locked on CUDA): adapters read from disk once, verified, packed as the
    # GPU holds them, and copied onto the GPU from here. 0: four times the GPU tier's bytes.
    adapter_host_bytes: int = 0
    adapter_loader_threads: int = 2  # threads reading adapters from disk into the host tier
    adapter_eviction: str = "lfu"  # which adapter leaves a full tier: lfu (access frequency with decay) or lru
    adapter_eviction_half_life_s: float = 60.0  # lfu: an access counts half as much after this long
    # A failed load fails new requests for the same adapter version this long without reading it again;
    # each failure in a row doubles the wait, up to adapter_failure_max_ttl_s.
    adapter_failure_ttl_s: float = 10.0
    adapter_failure_max_ttl_s: float = 300.0
    # Every adapter load runs to its end on the engine thread, stalling every stream (the behaviour
    # before the tiers): benchmarks/cold_start_bench.py's baseline, not for serving.
    adapter_synchronous_loads: bool = False
    # CPU LoRA workers (CaraServe's CPU-assisted prefill, gpu_worker/lora/cpu_assist.py): processes the
    # worker starts, each pinned to cpu_lora_cores_each cores of its GPU's NUMA node, that compute the
    # LoRA part of requests whose adapter is in host memory but not usable on the GPU yet, when the
    # cold-start policy takes that way (below). The host tier and their work area are files in
    # cpu_lora_shm_dir (memory: /dev/shm). 0: none. One core stays the worker's: a machine with too
    # few for them runs without (logged).
    cpu_lora_workers: int = 1
    cpu_lora_cores_each: int = 1
    cpu_lora_shm_dir: str = "/dev/shm"
    # process: the worker starts them; sidecar: a container beside it runs them (`tessera serve cpu-lora`,
    # cpu_lora_worker/sidecar.py) on the cores it was given, both mounting cpu_lora_shm_dir (Kubernetes).
    cpu_lora_launch: str = "process"
    # How a request starts whose adapter is in host memory but not usable on the GPU yet
    # (policy/cold_start.py): auto (the fastest way that keeps running requests within their
    # TPOT objective, as the gateway sent it), or one way alone: pipelined (layer-pipelined loading), cpu
    # (the CPU LoRA workers), wait (until the whole adapter is on the GPU).
    cold_start_policy: str = "auto"
    # The objectives of requests that came without their own (the gateway sends each request's): the
    # cold-start policy keeps shared steps within the TPOT; the mode policy's credits are held to both.
    default_tpot_slo_ms: float = 200.0
    default_ttft_slo_ms: float = 5000.0
    max_lora_rank: int = 64  # adapters of higher rank are refused by this worker
    # Projections that get adapter slots (memory: every slot holds max_lora_rank for each);
    # adapters targeting others are refused.
    lora_targets: list[str] = dataclasses.field(default_factory=lambda: [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    kv_block_size: int = 16  # tokens per KV-cache block
    # KV-cache size in tokens; 0: on CUDA, what fits in gpu_memory_utilization of the device after the
    # weights and a profiled forward pass; on CPU, 16384.
    kv_cache_tokens: int = 0
    gpu_memory_utilization: float = 0.9
    cuda_graphs: bool = True  # replay captured decode steps on CUDA
    # Async scheduling: launch each step before the step before it has brought its tokens to the host
    # (they feed it on the device), so the host's work between steps overlaps the device's. "cuda": on
    # CUDA devices only (on a CPU the step launched ahead runs at once, holding each token back a step);
    # "always"; "never".
    async_scheduling: str = "cuda"
    # On CUDA, compile every Triton kernel variant the limits above allow (LoRA, attention, merge)
    # before serving (seconds at the first start, Triton's disk cache after), so no request waits on
    # a compile.
    warm_up_kernels: bool = True
    # Inference modes (gpu_worker/orchestrator.py): each step runs unmerged (LoRA kernels), merged (one
    # adapter folded into the base weights; a saved copy of the weights it touches restores them
    # exactly) or mixture (merged, with other requests beside it), as the policy decides
    # (policy/mode_policies.py): credit (VaLoRA's credit-based policy priced with this worker
    # kind's profiled step costs), unmerged (never merge), merged (always one adapter merged) or dlora
    # (dLoRA's threshold switching). A request starves once its wait, the next step and a switch reach
    # mode_credit_theta times its objective for its next token.
    mode_policy: str = "credit"
    mode_credit_theta: float = 1.0
    # Prefix caching: a new request reuses the KV blocks of the longest prefix (whole blocks: tokens,
    # images, adapter) that an earlier request computed, and prefills only the rest.
    enable_prefix_caching: bool = True
    # Image-embedding cache: the vision encoder's features of recent images (by content hash), on the
    # model's device; 0 disables it.
    image_cache_bytes: int = 256 * 1024 * 1024
    adapter_store: str = ""  # "" -> {home}/adapters; adapters outside it are refused
    # Where a worker keeps the performance model it fitted by its own profile at start, when none is
    # committed for its kind (gpu_worker/pricing.py): "" -> {home}/perf_models.
    perf_model_cache: str = ""


@dataclasses.dataclass(slots=True)
class LauncherConfig:
    # The workers `tessera up` starts (services/launcher/plan.py), the k-th on worker.grpc_port + k and
    # worker.metrics_port + k. 0: one for each base model in worker_models, or, when that is empty, for
    # each base model registered (the demo's Llama, LLaVA and Qwen2-VL), else for worker.base_model.
    # N > 0: N workers of worker.base_model.
    workers: int = 0
    worker_models: list[str] = dataclasses.field(default_factory=list)
    health_timeout_s: float = 180.0
    restart_backoff_s: float = 1.0
    max_restart_backoff_s: float = 30.0


@dataclasses.dataclass(slots=True)
class TlsConfig:
    """Mutual TLS between the roles (services/common/tls.py; README "Security")."""

    # Off (plaintext, with a warning at each role's start) only when set false explicitly.
    enabled: bool = True
    dir: str = ""  # "" -> {home}/tls: ca.pem and <role>.pem, <role>-key.pem per role
    ca_key: str = ""  # "" -> {dir}/ca-key.pem; read only where certificates are issued
    # Names each role's certificate carries besides localhost, 127.0.0.1, ::1 and the hosts this
    # config binds or dials it at: compose service names, Kubernetes DNS names ("*.workers.ns.svc").
    registry_hosts: list[str] = dataclasses.field(default_factory=list)
    gateway_hosts: list[str] = dataclasses.field(default_factory=list)
    worker_hosts: list[str] = dataclasses.field(default_factory=list)
    # The gateway's public gRPC port never asks clients for a certificate: false, plaintext like the
    # REST port; true, TLS with the gateway's certificate (clients verify it with ca.pem).
    public_grpc_tls: bool = False


@dataclasses.dataclass(slots=True)
class TesseraConfig:
    home: str = "~/.tessera"  # db, adapter store, demo assets, run state
    log_level: str = "INFO"
    registry: RegistryConfig = dataclasses.field(default_factory=RegistryConfig)
    gateway: GatewayConfig = dataclasses.field(default_factory=GatewayConfig)
    worker: WorkerConfig = dataclasses.field(default_factory=WorkerConfig)
    launcher: LauncherConfig = dataclasses.field(default_factory=LauncherConfig)
    tls: TlsConfig = dataclasses.field(default_factory=TlsConfig)

    # Derived paths: one place that decides where things live.
    @property
    def home_path(self) -> Path:
        return Path(self.home).expanduser().resolve()

    @property
    def database_url(self) -> str:
        return self.registry.database_url or f"sqlite:///{self.home_path / 'registry.db'}"

    @property
    def adapter_store_path(self) -> Path:
        return Path(self.registry.adapter_store or self.home_path / "adapters").expanduser().resolve()

    @property
    def worker_adapter_store_path(self) -> Path:
        return Path(self.worker.adapter_store or self.adapter_store_path).expanduser().resolve()

    @property
    def perf_model_cache_path(self) -> Path:
        return Path(self.worker.perf_model_cache or self.home_path / "perf_models").expanduser().resolve()

    @property
    def import_root_paths(self) -> list[Path]:
        roots = self.registry.import_roots or [str(self.home_path)]
        return [Path(r).expanduser().resolve() for r in roots]

    @property
    def admin_api_key_path(self) -> Path:
        """Where the generated admin API key lives when none is configured."""
        return self.home_path / "admin_api_key"

    @property
    def models_path(self) -> Path:
        return self.home_path / "models"

    @property
    def run_path(self) -> Path:
        return self.home_path / "run"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _check_type(value: Any, annotation: Any, key: str) -> Any:
    origin = typing.get_origin(annotation)
    if origin is list:
        (item_type,) = typing.get_args(annotation)
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [_check_type(v, item_type, f"{key}[]") for v in value]
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if annotation is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, annotation) or (annotation is int and isinstance(value, bool)):
        raise ConfigError(f"{key}: expected {annotation.__name__}, got {value!r}")
    return value


def _apply(target: Any, values: Mapping[str, Any], prefix: str) -> None:
    hints = typing.get_type_hints(type(target))
    for key, value in values.items():
        name = f"{prefix}{key}"
        if key not in hints:
            raise ConfigError(f"unknown config key {name!r}")
        annotation = hints[key]
        if dataclasses.is_dataclass(annotation):
            if not isinstance(value, Mapping):
                raise ConfigError(f"{name}: expected a mapping")
            _apply(getattr(target, key), value, f"{name}.")
        else:
            setattr(target, key, _check_type(value, annotation, name))


def _env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    """TESSERA_GATEWAY__HTTP_PORT=9000 -> {"gateway": {"http_port": 9000}}."""
    hints = typing.get_type_hints(TesseraConfig)
    sections = {name for name, hint in hints.items() if dataclasses.is_dataclass(hint)}
    scalars = set(hints) - sections
    out: dict[str, Any] = {}
    for env_key, raw in environ.items():
        if not env_key.startswith(ENV_PREFIX) or env_key == "TESSERA_CONFIG":
            continue
        path = env_key[len(ENV_PREFIX):].lower().split("__")
        if len(path) == 1 and path[0] in scalars:
            out[path[0]] = _env_value(raw, hints[path[0]])
        elif len(path) == 2 and path[0] in sections:
            key_type = typing.get_type_hints(hints[path[0]]).get(path[1])
            out.setdefault(path[0], {})[path[1]] = _env_value(raw, key_type)
        else:
            raise ConfigError(f"unknown config environment variable {env_key}")
    return out


def _env_value(raw: str, annotation: Any) -> Any:
    """A string key takes the variable as written (a key or password "0123" stays "0123", not YAML's 83);
    the others parse it as a YAML scalar or list."""
    if annotation is str:
        return raw
    return yaml.safe_load(raw) if raw else ""


def load_config(path: str | os.PathLike[str] | None = None, environ: Mapping[str, str] | None = None) -> TesseraConfig:
    """Build the effective configuration (defaults <- YAML file <- environment)."""
    environ = os.environ if environ is None else environ
    config = TesseraConfig()
    path = path or environ.get("TESSERA_CONFIG")
    if path:
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"cannot read config file {path}: {exc}") from exc
        if not isinstance(data, Mapping):
            raise ConfigError(f"config file {path} must hold a mapping")
        _apply(config, data, "")
    _apply(config, _env_overrides(environ), "")
    return config
