"""Prometheus metrics of the worker, fed from the engine's per-step records."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from gpu_worker.engine import Engine, StepRecord
from services.common.metrics import LATENCY_BUCKETS

GENERATED_TOKENS = Counter("tessera_worker_generated_tokens_total", "Tokens sampled by the engine")
STEP_SECONDS = Histogram("tessera_worker_step_seconds",
                         "Time from an engine step's launch to its sampled tokens on the host", buckets=LATENCY_BUCKETS)
BATCH_TOKENS = Histogram("tessera_worker_step_tokens", "Packed tokens per engine step",
                         buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192))
# Distinct models (each adapter, and the base model) sharing one forward pass.
STEP_MODELS = Histogram("tessera_worker_step_models", "Distinct adapters (base model counted as one) per engine step",
                        buckets=(1, 2, 3, 4, 8, 16, 32, 64))
RUNNING = Gauge("tessera_worker_running_requests", "Sequences in the running batch")
WAITING = Gauge("tessera_worker_waiting_requests", "Sequences waiting for admission")


def record_step(step: StepRecord) -> None:
    GENERATED_TOKENS.inc(len(step.request_ids))
    STEP_SECONDS.observe(step.duration_s)
    BATCH_TOKENS.observe(step.num_tokens)
    STEP_MODELS.observe(len(set(step.adapters)))


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


def bind_engine_stats(engine: Engine) -> None:
    """The gauges and cache counters read the engine's stats snapshot whenever /metrics is scraped."""
    RUNNING.set_function(lambda: engine.stats().running_requests)
    WAITING.set_function(lambda: engine.stats().waiting_requests)
    REGISTRY.register(CacheMetrics(engine))
