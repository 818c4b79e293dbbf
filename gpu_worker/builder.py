"""Assembles an Engine from a checkpoint directory and the worker's configuration."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from gpu_worker.block_manager import BlockManager, blocks_for
from gpu_worker.cuda_graphs import DecodeGraphs
from gpu_worker.engine import Engine, StepRecord
from gpu_worker.kv_cache import CacheShape, PagedKVCache, cuda_blocks_that_fit
from gpu_worker.lora.adapter_manager import AdapterManager
from policy.cold_start import ColdStartPolicy
from gpu_worker.lora.cpu_assist import CpuLoraPool
from gpu_worker.lora.gpu_memory import GpuAdapterMemory
from gpu_worker.lora.loader import AdapterRef, LoRAWeights, load_adapter
from gpu_worker.lora.merge_switch import MergeSwitch
from gpu_worker.model_runner import ModelRunner
from gpu_worker.models.families import ServedModel, load_served_model
from gpu_worker.models.llama import LORA_TARGETS, LlamaForCausalLM, resolve_dtype
from gpu_worker.device_kind import device_name, perf_model_kind
from policy.mode_costs import load_step_cost, perf_model_cost
from policy.mode_policies import make_policy
from gpu_worker.orchestrator import UNMERGED, Orchestrator, Slos
from gpu_worker.scheduler import ScheduledSeq, Scheduler, SchedulerLimits
from gpu_worker.sequence import SamplingParams, Sequence
from gpu_worker.vision.image_cache import CachedImageEncoder, ImageFeatureCache
from gpu_worker.vision.images import ImageEncoder
from kernels import NO_SLOT, AdapterArena
from services.common.adapter_layout import TEXT_LAYOUT, AdapterLayout
from services.common.tower_lora import TowerModule
from services.common.config import ConfigError, WorkerConfig
from services.common.errors import FailedPrecondition
from services.common.shm_claims import ShmClaim, claim, reclaim_orphans
from policy.perf_model import PerfModel
from services.common.cpu_lora.numa import choose_cores, gpu_numa_node, read_topology
from services.common.cpu_lora.sidecar import SidecarWorkers
from services.common.cpu_lora.supervisor import CpuLoraSupervisor
from policy.eviction import LRU, Eviction, LFUDecay

log = logging.getLogger(__name__)

CPU_KV_CACHE_TOKENS = 16384
ASYNC_SCHEDULING = ("cuda", "always", "never")


def build_engine(checkpoint_dir: Path, worker: WorkerConfig, adapter_store: Path,
                 on_step: Callable[[StepRecord], None] | None = None,
                 price: Callable[[LlamaForCausalLM], PerfModel] | None = None) -> Engine:
    """`price`: the performance model of the loaded (language) model, which the mode policy prices steps
    with (gpu_worker/pricing.py); without it, the one committed for this worker's kind, if any."""
    device = serving_device(worker.device)
    async_scheduling = async_scheduling_on(worker.async_scheduling, device)  # a bad setting fails before the load
    dtype = resolve_dtype(worker.dtype, device)
    served = load_served_model(checkpoint_dir, device=device, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint_dir)
    perf_model = price(served.language_model) if price else None
    return assemble_engine(served, tokenizer, worker, adapter_store, on_step, async_scheduling=async_scheduling,
                           perf_model=perf_model)


@dataclass(frozen=True)
class EngineParts:
    """The engine's machinery without its thread and request plumbing (benchmarks drive these)."""
    model: LlamaForCausalLM
    runner: ModelRunner
    scheduler: Scheduler
    adapters: AdapterManager
    orchestrator: Orchestrator
    cold_start: ColdStartPolicy  # the scheduler's and the orchestrator's; the engine times its steps


def assemble_engine(served: ServedModel, tokenizer: PreTrainedTokenizerBase, worker: WorkerConfig,
                    adapter_store: Path, on_step: Callable[[StepRecord], None] | None, *,
                    async_scheduling: bool, perf_model: PerfModel | None = None) -> Engine:
    """An engine around an already loaded model (a vision-language model's processor included)."""
    parts = assemble_parts(served.language_model, worker, adapter_store, image_encoder=served.image_encoder,
                           adapter_layout=served.adapter_layout, tower=served.tower, perf_model=perf_model)
    return Engine(base_model=worker.base_model, runner=parts.runner, scheduler=parts.scheduler,
                  orchestrator=parts.orchestrator, adapters=parts.adapters, cold_start=parts.cold_start, tokenizer=tokenizer,
                  max_context=parts.model.max_context, max_lora_rank=worker.max_lora_rank, on_step=on_step,
                  processor=served.processor, async_scheduling=async_scheduling)


def serving_device(name: str) -> torch.device:
    """worker.device as a torch device; ConfigError for one this process cannot use."""
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise ConfigError(f"worker.device: {name!r} is not a device ({exc}); use cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        raise ConfigError(f"worker.device is {name!r}, but this torch ({torch.__version__}, {build}) sees no "
                          "CUDA device: set worker.device: cpu, or run on a machine with an NVIDIA GPU and a "
                          "CUDA build of torch")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ConfigError(f"worker.device is {name!r}, but this machine has {torch.cuda.device_count()} CUDA "
                          "device(s)")
    return device


def async_scheduling_on(setting: str, device: torch.device) -> bool:
    """worker.async_scheduling for `device`. "cuda" keeps it to devices that run apart from the host:
    a CPU computes a step as it is launched, so running one ahead would only delay each token."""
    if setting not in ASYNC_SCHEDULING:
        raise ConfigError(f"worker.async_scheduling: expected one of {', '.join(ASYNC_SCHEDULING)}, "
                          f"got {setting!r}")
    return setting == "always" or (setting == "cuda" and device.type == "cuda")


def assemble_parts(model: LlamaForCausalLM, worker: WorkerConfig, adapter_store: Path,
                   load: Callable[[AdapterRef], LoRAWeights] | None = None, *,
                   image_encoder: ImageEncoder | None = None, adapter_layout: AdapterLayout = TEXT_LAYOUT,
                   tower: dict[str, TowerModule] | None = None, perf_model: PerfModel | None = None) -> EngineParts:
    """Adapter tiers, KV cache, scheduler, orchestrator and runner (with CUDA graphs on CUDA) for `model`.
    `load` replaces reading adapters from the store (benchmarks use random weights; it runs on the
    adapter loader threads);
    `image_encoder` serves a vision-language model's images; `adapter_layout` names its LoRA tensors, `tower`
    the linears of its vision tower that LoRA may adapt;
    `perf_model` prices the mode policy's steps (None: the model committed for this worker's kind)."""
    config = model.config
    device = model.lm_head.weight.device
    # One arena for every adapter weight, allocated before the KV cache is sized.
    dtype = model.lm_head.weight.dtype
    largest = model.lora_adapter_elems(worker.max_lora_rank, worker.lora_targets) * dtype.itemsize
    budget = worker.adapter_gpu_bytes or worker.adapter_slots * largest
    if budget < largest:
        raise ConfigError(f"worker.adapter_gpu_bytes: {budget} bytes cannot hold one adapter of rank "
                          f"{worker.max_lora_rank} on {', '.join(worker.lora_targets)} ({largest} bytes)")
    arena = AdapterArena(budget // dtype.itemsize, dtype, device)
    seats = GpuAdapterMemory.seats(budget, largest, worker.max_lora_rank)
    merging = worker.mode_policy != "unmerged" and worker.adapter_slots > 0
    model.init_lora_slots(seats + merging, worker.max_lora_rank, worker.lora_targets, arena)  # + the mixture slot
    layers = model.lora_layers(worker.lora_targets)
    merge_switch = None
    if merging:
        # Its backups of the base weights are taken here, before the KV cache is sized on what is left.
        merge_switch = MergeSwitch(list({id(m): m for m, _ in layers.values()}.values()))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    shape = CacheShape(config.num_hidden_layers, config.num_key_value_heads, head_dim, model.lm_head.weight.dtype, device)
    num_blocks = _num_kv_blocks(model, shape, worker)
    kv_cache = PagedKVCache(shape, num_blocks, worker.kv_block_size)
    log.info("KV cache: %d blocks of %d tokens (%.2f GiB)", num_blocks, worker.kv_block_size,
             num_blocks * shape.bytes_per_block(worker.kv_block_size) / 2**30)
    served_paths = {target: LORA_TARGETS[target] for target in worker.lora_targets}

    def load_from_store(ref: AdapterRef) -> LoRAWeights:
        return load_adapter(ref, adapter_store, adapter_layout, served_paths, config.num_hidden_layers,
                            config.hidden_size, tower)

    def load_checked(ref: AdapterRef) -> LoRAWeights:
        weights = (load or load_from_store)(ref)
        if weights.rank > worker.max_lora_rank:
            raise FailedPrecondition(f"adapter {ref.name} has rank {weights.rank}; this worker serves ranks up "
                                     f"to {worker.max_lora_rank} (max_lora_rank)")
        return weights

    memory = GpuAdapterMemory(layers, arena, worker.max_lora_rank, merge_switch)
    cpu_lora_workers = _cpu_lora_workers(worker, device)
    shm = _shm_claim(worker) if cpu_lora_workers is not None else None
    adapters = adapter_manager(memory, load_checked, worker, shm and shm.path("host"))
    cpu_lora = _cpu_lora_pool(worker, adapters, memory, shm, cpu_lora_workers) if shm and cpu_lora_workers else None
    cold_start = _cold_start_policy(worker)
    scheduler = Scheduler(SchedulerLimits(worker.max_num_seqs, worker.max_batch_tokens),
                          BlockManager(num_blocks, worker.kv_block_size, worker.enable_prefix_caching), adapters,
                          cold_start, cpu_lora.extra_step_s if cpu_lora else lambda tokens, packed: None)
    if device.type == "cuda" and worker.warm_up_kernels:
        _warm_up_kernels(model, worker, shape, merge_switch)
    graphs = None
    if device.type == "cuda" and worker.cuda_graphs:
        graphs = DecodeGraphs(model, kv_cache, max_batch=worker.max_num_seqs,
                              max_context=model.max_context, with_lora=worker.adapter_slots > 0)
    images = CachedImageEncoder(image_encoder, ImageFeatureCache(worker.image_cache_bytes)) \
        if image_encoder is not None else None
    runner = ModelRunner(model, kv_cache, device, graphs, merge_switch, images, cpu_lora, memory.modules, memory.head,
                         lambda seq: memory.host_tower(seq.cpu_adapter) if seq.cpu_adapter is not None
                         else memory.tower(seq.slot))
    return EngineParts(model, runner, scheduler, adapters,
                       _orchestrator(worker, merge_switch, device, perf_model, cold_start), cold_start)


def adapter_manager(memory: GpuAdapterMemory, read: Callable[[AdapterRef], LoRAWeights],
                    worker: WorkerConfig, host_path: Path | None = None) -> AdapterManager:
    """The adapter tiers as worker.adapter_* say: the GPU tier is `memory`, the host tier
    adapter_host_bytes (0: four times the GPU tier's bytes), in a file at `host_path` if given."""
    host_bytes = worker.adapter_host_bytes or 4 * memory.budget_bytes
    if host_bytes < memory.budget_bytes:
        raise ConfigError(f"worker.adapter_host_bytes: the host tier holds a copy of every GPU adapter, so it needs "
                          f"at least the GPU tier's {memory.budget_bytes} bytes, got {host_bytes}")
    if worker.adapter_loader_threads < 1:
        raise ConfigError("worker.adapter_loader_threads must be >= 1")
    if not 0 <= worker.adapter_failure_ttl_s <= worker.adapter_failure_max_ttl_s:
        raise ConfigError(f"worker.adapter_failure_ttl_s ({worker.adapter_failure_ttl_s}) must be >= 0 and at most "
                          f"worker.adapter_failure_max_ttl_s ({worker.adapter_failure_max_ttl_s})")
    return AdapterManager(memory, read, host_bytes=host_bytes, loader_threads=worker.adapter_loader_threads,
                          eviction=_eviction(worker), failure_ttl_s=worker.adapter_failure_ttl_s,
                          failure_max_ttl_s=worker.adapter_failure_max_ttl_s, synchronous=worker.adapter_synchronous_loads, host_path=host_path)


def _cpu_lora_workers(worker: WorkerConfig, device: torch.device) -> CpuLoraSupervisor | SidecarWorkers | None:
    """The CPU LoRA workers as worker.cpu_lora_launch says: processes this worker starts on cores of the GPU's
    NUMA node (any node on a CPU device), or a sidecar's. None without them, or when this machine has too
    few cores for local ones beside the worker (logged: the worker serves without CPU assistance, as on a
    one-core machine with the default settings)."""
    if worker.cpu_lora_workers < 0 or worker.cpu_lora_cores_each < 1:
        raise ConfigError("worker.cpu_lora_workers must be >= 0 and worker.cpu_lora_cores_each >= 1")
    if worker.cpu_lora_launch not in ("process", "sidecar"):
        raise ConfigError(f"worker.cpu_lora_launch: expected process or sidecar, got {worker.cpu_lora_launch!r}")
    if not worker.cpu_lora_workers:
        return None
    if worker.cpu_lora_launch == "sidecar":
        return SidecarWorkers(worker.cpu_lora_workers)
    bus_id = getattr(torch.cuda.get_device_properties(device), "pci_bus_id", None) if device.type == "cuda" else None
    node = gpu_numa_node(bus_id) if bus_id else None
    try:
        cores = choose_cores(read_topology(), node, worker.cpu_lora_workers, worker.cpu_lora_cores_each)
    except ValueError as exc:
        log.warning("no CPU LoRA workers: %s (worker.cpu_lora_workers, worker.cpu_lora_cores_each)", exc)
        return None
    log.info("CPU LoRA workers on cores %s (NUMA node %s)", cores, node)
    return CpuLoraSupervisor(cores, node)


def _shm_claim(worker: WorkerConfig) -> ShmClaim:
    """A claim on new files for the host tier and the CPU LoRA work area (services/common/shm_claims.py);
    the files that workers now gone left in the directory (killed, or a sidecar pod's previous container)
    are removed first."""
    directory = Path(worker.cpu_lora_shm_dir)
    if not directory.is_dir():
        raise ConfigError(f"worker.cpu_lora_shm_dir: {directory} is not a directory")
    reclaim_orphans(directory)
    return claim(directory)


def _cpu_lora_pool(worker: WorkerConfig, adapters: AdapterManager, memory: GpuAdapterMemory, shm: ShmClaim,
                   workers: CpuLoraSupervisor | SidecarWorkers) -> CpuLoraPool:
    modules = memory.modules
    pool = CpuLoraPool(shm, adapters.host_pages, memory.dtype, workers, max_tokens=worker.max_batch_tokens,
                       max_in=max(m.in_features for m in modules), max_out=max(m.out_features for m in modules),
                       max_segments=worker.max_num_seqs * max(len(m.out_sizes) for m in modules))
    pool.start()
    return pool


def _cold_start_policy(worker: WorkerConfig) -> ColdStartPolicy:
    try:
        return ColdStartPolicy(worker.cold_start_policy, _default_slos(worker).tpot_s)
    except ValueError as exc:
        raise ConfigError(f"worker.cold_start_policy: {exc}") from None


def _default_slos(worker: WorkerConfig) -> Slos:
    if not (worker.default_tpot_slo_ms > 0 and worker.default_ttft_slo_ms > 0):
        raise ConfigError(f"worker.default_tpot_slo_ms and default_ttft_slo_ms must be positive, got "
                          f"{worker.default_tpot_slo_ms} and {worker.default_ttft_slo_ms}")
    return Slos(worker.default_ttft_slo_ms / 1e3, worker.default_tpot_slo_ms / 1e3)


def _orchestrator(worker: WorkerConfig, merge_switch: MergeSwitch | None, device: torch.device,
                  perf_model: PerfModel | None, cold_start: ColdStartPolicy) -> Orchestrator:
    """The mode policy `worker.mode_policy` names, priced with this worker kind's profiled step costs."""
    if not worker.mode_credit_theta > 0:
        raise ConfigError(f"worker.mode_credit_theta must be positive, got {worker.mode_credit_theta}")
    cost = perf_model_cost(perf_model) if perf_model else \
        load_step_cost(perf_model_kind(device_name(device), worker.base_model))
    try:
        policy = make_policy(worker.mode_policy, worker.mode_credit_theta, cost)
    except ValueError as exc:
        raise ConfigError(f"worker.mode_policy: {exc}") from None
    return Orchestrator(merge_switch, policy, _default_slos(worker), cold_start)


def _eviction(worker: WorkerConfig) -> Eviction:
    if worker.adapter_eviction == "lru":
        return LRU()
    if worker.adapter_eviction != "lfu":
        raise ConfigError(f"worker.adapter_eviction: expected lfu or lru, got {worker.adapter_eviction!r}")
    if not worker.adapter_eviction_half_life_s > 0:
        raise ConfigError(f"worker.adapter_eviction_half_life_s must be positive, got "
                          f"{worker.adapter_eviction_half_life_s}")
    return LFUDecay(worker.adapter_eviction_half_life_s)


def _warm_up_kernels(model: LlamaForCausalLM, worker: WorkerConfig, shape: CacheShape,
                     merge_switch: MergeSwitch | None) -> None:
    """Compile every Triton kernel variant the worker's steps can select (attention, the skinny
    matmuls, LoRA, merge) before it serves: seconds at a first start, Triton's disk cache after.
    The decode graphs' capture compiles the rest (norms, rotary), as it runs every decode batch size."""
    from kernels import SKINNY_MAX_ROWS
    from kernels.triton.attention import warm_up_attention  # CUDA only: CPU installs may lack a GPU triton
    from kernels.triton.compile_ahead import compiling_ahead
    from kernels.triton.linear import warm_up_linear
    from kernels.triton.lora_warmup import warm_up_lora

    started = time.perf_counter()
    modules = {id(m): m for m, _ in model.lora_layers(LORA_TARGETS).values()}.values()  # every projection
    stacks = [m.lora for m, _ in model.lora_layers(worker.lora_targets).values() if m.lora is not None]
    with compiling_ahead():
        attention = warm_up_attention(model.config.num_attention_heads, shape.num_kv_heads, shape.head_dim,
                                      worker.kv_block_size, shape.dtype, shape.device)
        linear = 0
        if shape.dtype in (torch.float16, torch.bfloat16):  # what kernels.linear sends to the skinny kernel
            projections = [(m.weight, m.bias) for m in modules] + [(model.lm_head.weight, None)]
            linear = warm_up_linear(projections, SKINNY_MAX_ROWS)
        lora = warm_up_lora(stacks, worker.max_batch_tokens, min(stacks[0].num_slots, worker.max_num_seqs),
                            mixture=merge_switch is not None) if stacks else 0
        if merge_switch is not None:
            merge_switch.warm_up()
    log.info("kernels warmed up: %d attention, %d matmul and %d LoRA shrink/expand variants%s, compiled or "
             "found in Triton's cache in %.1f s", attention, linear, lora, " and merge/restore" if merge_switch else "",
             time.perf_counter() - started)


def _num_kv_blocks(model: LlamaForCausalLM, shape: CacheShape, worker: WorkerConfig) -> int:
    """+1: block 0 is the scratch block."""
    if worker.kv_cache_tokens > 0:
        return blocks_for(worker.kv_cache_tokens, worker.kv_block_size) + 1
    if shape.device.type != "cuda":
        return blocks_for(CPU_KV_CACHE_TOKENS, worker.kv_block_size) + 1
    peak = _profile_peak_bytes(model, shape, worker)
    return cuda_blocks_that_fit(shape, worker.kv_block_size, worker.gpu_memory_utilization, peak)


def _profile_peak_bytes(model: LlamaForCausalLM, shape: CacheShape, worker: WorkerConfig) -> int:
    """Peak device memory of a forward pass over max_batch_tokens tokens on an adapter slot, less
    the scratch cache it needs: what must stay free beside the KV cache."""
    block_size, max_context = worker.kv_block_size, model.max_context
    items, next_block, remaining = [], 1, worker.max_batch_tokens
    while remaining > 0:  # prompts of at most one context each
        n = min(remaining, max_context)
        seq = Sequence(f"profile-{len(items)}", [0] * n, SamplingParams(max_tokens=1), None, None)
        seq.slot = 0 if worker.adapter_slots else NO_SLOT
        seq.block_table = list(range(next_block, next_block + blocks_for(n, block_size)))
        next_block += len(seq.block_table)
        items.append(ScheduledSeq(seq, n, samples=True))
        remaining -= n
    cache = PagedKVCache(shape, next_block, block_size)
    cache_bytes = next_block * shape.bytes_per_block(block_size)
    torch.cuda.reset_peak_memory_stats(shape.device)
    ModelRunner(model, cache, shape.device).run(items, UNMERGED)
    torch.cuda.synchronize(shape.device)
    peak = torch.cuda.max_memory_allocated(shape.device) - cache_bytes
    del cache
    torch.cuda.empty_cache()
    return peak
