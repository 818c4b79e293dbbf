"""The engine's load and cache counters as one immutable snapshot.

The engine thread takes a snapshot whenever its state changed (after each step's outputs, applied
submits and aborts, retired requests); callers on other threads read the latest one. It feeds
GetStats (servicer.py), the state pushed to the gateway (state_push.py) and /metrics (metrics.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpu_worker.lora.adapter_manager import AdapterManager
from gpu_worker.lora.cpu_assist import CpuLoraPool, CpuLoraStats
from gpu_worker.lora.adapter_stats import AdapterTierStats
from gpu_worker.scheduler import Scheduler
from gpu_worker.sequence import Sequence
from gpu_worker.vision.image_cache import ImageFeatureCache

_NO_IMAGE_CACHE = ImageFeatureCache(0)  # a text model's image-cache stats: all zeros


@dataclass(frozen=True)
class SeqLoad:
    """A sequence as the gateway's performance model prices it."""
    adapter: str | None
    rank: int
    tokens: int  # running: context so far; waiting: tokens to (re)compute before its first decode


@dataclass(frozen=True)
class EngineStats:
    running_requests: int
    waiting_requests: int
    running_ranks: tuple[int, ...]
    resident_adapters: tuple[str, ...]  # adapter names usable on the GPU (adapters.gpu_adapters)
    free_kv_tokens: int
    preemptions_total: int
    adapter_slots: int
    pinned_adapters: int    # adapter pins held by live requests (one each, from arrival to end)
    generated_tokens_total: int
    busy_seconds_total: float  # wall time a step was on the device (async steps' overlap counted once)
    adapters: AdapterTierStats  # the adapter tiers: residency by tier, bytes, loads, hits, evictions
    prefix_cache_hit_tokens_total: int = 0  # prompt tokens whose K/V came from the prefix cache
    prefix_cache_query_tokens_total: int = 0  # tokens of sequences admitted with prefix caching on
    prefix_cache_blocks: int = 0            # KV blocks whose content is published (in use or evictable)
    prefix_cache_evicted_blocks_total: int = 0
    image_cache_hits_total: int = 0         # images whose features came from the image-embedding cache
    image_cache_misses_total: int = 0       # images that went through the vision encoder
    image_cache_evictions_total: int = 0
    image_cache_entries: int = 0
    image_cache_bytes: int = 0
    image_cache_capacity_bytes: int = 0     # image_cache_bytes of the config; 0 for a text model
    running_load: tuple[SeqLoad, ...] = ()
    waiting_load: tuple[SeqLoad, ...] = ()
    cpu_lora: CpuLoraStats = CpuLoraStats()  # the CPU LoRA workers (none configured: zeros)
    # Sequences admitted whose adapter was not usable on the GPU, by how they started (policy/cold_start.py).
    cold_starts_total: dict[str, int] = field(default_factory=dict)
    # Requests each adapter brought since the start, by name (the registry places adapters by them).
    adapter_requests_total: dict[str, int] = field(default_factory=dict)


def snapshot(scheduler: Scheduler, adapters: AdapterManager, image_cache: ImageFeatureCache | None,
             generated_tokens_total: int, busy_seconds_total: float, cpu_lora: CpuLoraPool | None = None,
             adapter_requests_total: dict[str, int] | None = None) -> EngineStats:
    """The stats now; `image_cache` is None for a text model, `cpu_lora` without CPU LoRA workers."""
    running, blocks = scheduler.running, scheduler.blocks
    images = image_cache if image_cache is not None else _NO_IMAGE_CACHE
    tiers = adapters.stats()
    return EngineStats(
        running_requests=len(running),
        waiting_requests=len(scheduler.waiting),
        running_ranks=tuple(seq.rank for seq in running),
        resident_adapters=tiers.gpu_adapters,
        free_kv_tokens=blocks.free_tokens(),
        preemptions_total=scheduler.num_preemptions,
        adapter_slots=adapters.num_slots,
        pinned_adapters=tiers.pinned,
        generated_tokens_total=generated_tokens_total,
        busy_seconds_total=busy_seconds_total,
        prefix_cache_hit_tokens_total=blocks.prefix_hit_tokens,
        prefix_cache_query_tokens_total=blocks.prefix_query_tokens,
        prefix_cache_blocks=blocks.num_cached_blocks,
        prefix_cache_evicted_blocks_total=blocks.evicted_blocks,
        image_cache_hits_total=images.hits,
        image_cache_misses_total=images.misses,
        image_cache_evictions_total=images.evictions,
        image_cache_entries=len(images),
        image_cache_bytes=images.bytes_used,
        image_cache_capacity_bytes=images.max_bytes,
        running_load=tuple(map(_seq_load, running)),
        waiting_load=tuple(map(_seq_load, scheduler.waiting)),
        adapters=tiers,
        cpu_lora=cpu_lora.stats() if cpu_lora is not None else CpuLoraStats(),
        cold_starts_total={str(way): count for way, count in scheduler.cold_start.started.items()},
        adapter_requests_total=dict(adapter_requests_total or {}))


def _seq_load(seq: Sequence) -> SeqLoad:
    adapter = seq.adapter
    return SeqLoad(adapter.name if adapter else None, adapter.rank if adapter else 0, seq.num_tokens)
