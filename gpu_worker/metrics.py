"""Prometheus metrics of the worker, fed from the engine's per-step records."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.registry import Collector

from gpu_worker.engine import Engine, StepRecord
from gpu_worker.lora.adapter_stats import LOAD_BUCKETS, AdapterTierStats
from services.common.metrics import LATENCY_BUCKETS

GENERATED_TOKENS = Counter("tessera_worker_generated_tokens_total", "Tokens sampled by the engine")
STEP_SECONDS = Histogram("tessera_worker_step_seconds",
                         "Time from an engine step's launch to its sampled tokens on the host", buckets=LATENCY_BUCKETS)
BATCH_TOKENS = Histogram("tessera_worker_step_tokens", "Packed tokens per engine step",
                         buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192))
# Distinct models (each adapter, and the base model) sharing one forward pass.
STEP_MODELS = Histogram("tessera_worker_step_models", "Distinct adapters (base model counted as one) per engine step",
                        buckets=(1, 2, 3, 4, 8, 16, 32, 64))
MODE_STEPS = Counter("tessera_worker_mode_steps", "Engine steps by inference mode (orchestrator.py): merged (one "
                     "adapter folded into the base weights), mixture (folded in, other adapters beside it) or "
                     "unmerged", ["mode"])
MODE_SECONDS = Counter("tessera_worker_mode_seconds", "Engine steps' time (launch to tokens) by inference mode", ["mode"])
MODE_SWITCHES = Counter("tessera_worker_mode_switches", "Steps that run on other weights than the step before: "
                        "a merge, a restore, or both")
STARVING = Gauge("tessera_worker_starving_requests", "Requests past their credit threshold (their wait, the next "
                 "step and a switch against their TTFT or TPOT objective) when the last step's mode was decided")
RUNNING = Gauge("tessera_worker_running_requests", "Sequences in the running batch")
WAITING = Gauge("tessera_worker_waiting_requests", "Sequences waiting for admission")


class StepMetrics:
    """The engine's on_step: each step record into the metrics above (engine thread)."""

    def __init__(self) -> None:
        self._merged: str | None = None  # the adapter folded into the weights for the step before

    def __call__(self, step: StepRecord) -> None:
        GENERATED_TOKENS.inc(len(step.request_ids))
        STEP_SECONDS.observe(step.duration_s)
        BATCH_TOKENS.observe(step.num_tokens)
        STEP_MODELS.observe(len(set(step.adapters)))
        MODE_STEPS.labels(step.mode).inc()
        MODE_SECONDS.labels(step.mode).inc(step.duration_s)
        STARVING.set(step.starving)
        if step.merged_adapter != self._merged:
            MODE_SWITCHES.inc()
            self._merged = step.merged_adapter


class CacheMetrics(Collector):
    """The prefix and image caches' totals and sizes, which the engine counts itself, read from its
    stats snapshot at each scrape. Prefix-cache hit rate:
    rate(tessera_worker_prefix_cache_hit_tokens_total) / rate(tessera_worker_prefix_cache_query_tokens_total)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        s = self._engine.stats()
        yield CounterMetricFamily("tessera_worker_prefix_cache_hit_tokens", "Prompt tokens whose KV came from "
                                  "the prefix cache", value=s.prefix_cache_hit_tokens_total)
        yield CounterMetricFamily("tessera_worker_prefix_cache_query_tokens", "Tokens of the sequences admitted "
                                  "with prefix caching on", value=s.prefix_cache_query_tokens_total)
        yield CounterMetricFamily("tessera_worker_prefix_cache_evicted_blocks", "Cached KV blocks reused for other "
                                  "content", value=s.prefix_cache_evicted_blocks_total)
        yield GaugeMetricFamily("tessera_worker_prefix_cache_blocks", "KV blocks holding reusable content (in use "
                                "or evictable)", value=s.prefix_cache_blocks)
        yield CounterMetricFamily("tessera_worker_image_cache_hits", "Images whose features came from the "
                                  "image-embedding cache", value=s.image_cache_hits_total)
        yield CounterMetricFamily("tessera_worker_image_cache_misses", "Images run through the vision encoder",
                                  value=s.image_cache_misses_total)
        yield CounterMetricFamily("tessera_worker_image_cache_evictions", "Image features dropped from the "
                                  "image-embedding cache to make room", value=s.image_cache_evictions_total)
        yield GaugeMetricFamily("tessera_worker_image_cache_entries", "Images in the image-embedding cache",
                                value=s.image_cache_entries)
        yield GaugeMetricFamily("tessera_worker_image_cache_bytes", "Bytes of features in the image-embedding "
                                "cache", value=s.image_cache_bytes)
        yield GaugeMetricFamily("tessera_worker_image_cache_capacity_bytes", "Byte budget of the image-embedding "
                                "cache (0: none)", value=s.image_cache_capacity_bytes)


class CpuLoraMetrics(Collector):
    """The CPU LoRA workers (gpu_worker/lora/cpu_assist.py) from the engine's stats snapshot: how many answer
    jobs, how many jobs they took, the shares the worker computed itself, restarts, and how cold requests
    started (on them, layer-pipelined or waiting: policy/cold_start.py)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        s = self._engine.stats()
        workers = GaugeMetricFamily("tessera_worker_cpu_lora_workers", "CPU LoRA worker processes, configured and "
                                    "ready for jobs", labels=["state"])
        workers.add_metric(["configured"], s.cpu_lora.workers)
        workers.add_metric(["ready"], s.cpu_lora.ready)
        yield workers
        yield CounterMetricFamily("tessera_worker_cpu_lora_jobs", "Projections' LoRA jobs posted to the CPU LoRA "
                                  "workers", value=s.cpu_lora.jobs)
        yield CounterMetricFamily("tessera_worker_cpu_lora_local_shares", "Shares of CPU LoRA jobs the worker "
                                  "computed itself (a CPU LoRA worker dead, stuck or failing)",
                                  value=s.cpu_lora.local_shares)
        yield CounterMetricFamily("tessera_worker_cpu_lora_restarts", "CPU LoRA workers started again after "
                                  "they exited", value=s.cpu_lora.restarts)
        cold = CounterMetricFamily("tessera_worker_cold_starts", "Sequences admitted whose adapter was not usable "
                                   "on the GPU, by how they started: pipelined (while its copy ran), cpu (on the "
                                   "CPU LoRA workers) or wait (once it was usable)", labels=["way"])
        for way, count in sorted(s.cold_starts_total.items()):
            cold.add_metric([way], count)
        yield cold


class AdapterTierMetrics(Collector):
    """The adapter tiers (gpu_worker/lora/adapter_manager.py) from the engine's stats snapshot, labelled by
    tier or source tier only (no adapter names: the label sets stay fixed however many adapters come).
    Hit rate: rate(tessera_worker_adapter_hits_total) / (that + rate(tessera_worker_adapter_misses_total))."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily | HistogramMetricFamily]:
        s: AdapterTierStats = self._engine.stats().adapters
        by_tier = (("gpu", s.gpu_versions, s.gpu_bytes, s.gpu_capacity_bytes, s.gpu_evictions),
                   ("host", s.host_versions, s.host_bytes, s.host_capacity_bytes, s.host_evictions))
        families = (GaugeMetricFamily("tessera_worker_adapters", "Adapter versions held in a tier (the host tier "
                                      "includes the GPU's)", labels=["tier"]),
                    GaugeMetricFamily("tessera_worker_adapter_bytes", "Bytes adapters occupy in a tier, as budgeted",
                                      labels=["tier"]),
                    GaugeMetricFamily("tessera_worker_adapter_capacity_bytes", "A tier's byte budget", labels=["tier"]),
                    CounterMetricFamily("tessera_worker_adapter_evictions", "Adapters evicted from a tier to make "
                                        "room (from host: to disk)", labels=["tier"]))
        for tier, *values in by_tier:
            for family, value in zip(families, values):
                family.add_metric([tier], value)
        yield from families
        yield GaugeMetricFamily("tessera_worker_adapters_loading", "Adapters on their way to the GPU",
                                value=len(s.loading_adapters))
        yield CounterMetricFamily("tessera_worker_adapter_hits", "Requests whose adapter was usable on the GPU "
                                  "when they arrived", value=s.hits)
        yield CounterMetricFamily("tessera_worker_adapter_misses", "Requests whose adapter had to be loaded",
                                  value=s.misses)
        yield CounterMetricFamily("tessera_worker_adapter_load_failures", "Adapter loads that failed",
                                  value=s.load_failures)
        yield CounterMetricFamily("tessera_worker_adapter_gpu_compactions", "Times the GPU adapter memory closed "
                                  "its holes before an install (adapters moved on the device)",
                                  value=s.gpu_compactions)
        loads = HistogramMetricFamily("tessera_worker_adapter_load_seconds", "Adapter loads by source tier: disk "
                                      "(read, verify, parse, into host memory), host (copy onto the GPU)",
                                      labels=["source"])
        for times in s.loads:
            cumulative = [sum(times.counts[:i + 1]) for i in range(len(LOAD_BUCKETS))]
            buckets = [(str(le), n) for le, n in zip(LOAD_BUCKETS, cumulative)] + [("+Inf", times.count)]
            loads.add_metric([times.source], buckets, times.sum_s)
        yield loads


def bind_engine_stats(engine: Engine) -> None:
    """The gauges, cache counters and adapter tiers read the engine's stats snapshot whenever /metrics is scraped."""
    RUNNING.set_function(lambda: engine.stats().running_requests)
    WAITING.set_function(lambda: engine.stats().waiting_requests)
    REGISTRY.register(CacheMetrics(engine))
    REGISTRY.register(AdapterTierMetrics(engine))
    REGISTRY.register(CpuLoraMetrics(engine))
