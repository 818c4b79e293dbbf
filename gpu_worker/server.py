"""The gpu_worker process: find the checkpoint via the registry, load it, serve WorkerService."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from pathlib import Path

from grpc_health.v1 import health
from grpc_health.v1.health_pb2 import HealthCheckResponse

from gpu_worker import metrics
from gpu_worker.builder import build_engine, serving_device
from gpu_worker.models.llama import LlamaForCausalLM
from gpu_worker.pricing import resolve_perf_model
from gpu_worker.registry_client import RegistryClient, WorkerIdentity, fetch_base_model
from gpu_worker.servicer import WorkerServicer, worker_stats
from gpu_worker.state_push import StateSource
from gpu_worker.stats import EngineStats
from services.common.config import TesseraConfig
from services.common.grpc_server import start_grpc_server
from services.common.logs import setup_logging
from services.common.metrics import start_metrics_server
from policy.perf_model import PerfModel
from services.common.runtime import freeze_startup_heap, run_until_signalled
from services.common.tls import RoleCredentials, aio_channel, cluster_credentials
from tessera.v1 import worker_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = "tessera.v1.WorkerService"


async def _main(config: TesseraConfig, tls: RoleCredentials | None, stop: asyncio.Event) -> None:
    w = config.worker
    async with aio_channel(w.registry_address, tls.channel() if tls else None) as channel:
        base = await fetch_base_model(channel, w.base_model, stop)
        if base is None:
            return
        log.info("loading %s from %s on %s", base.name, base.path, w.device)
        priced: list[PerfModel] = []

        def price(model: LlamaForCausalLM) -> PerfModel:
            priced.append(resolve_perf_model(model, w.base_model, w.max_lora_rank, w.lora_targets,
                                             config.perf_model_cache_path))
            return priced[0]
        engine = await asyncio.to_thread(build_engine, Path(base.path), w, config.worker_adapter_store_path,
                                         metrics.StepMetrics(), price)
        freeze_startup_heap()
        engine.start()
        metrics.bind_engine_stats(engine)
        start_metrics_server(w.host, w.metrics_port)
        log.info("reporting perf model kind %s", priced[0].kind)
        state = StateSource(engine, priced[0], w.max_num_seqs)
        server = await start_grpc_server(
            f"{w.host}:{w.grpc_port}",
            lambda s: worker_pb2_grpc.add_WorkerServiceServicer_to_server(WorkerServicer(engine, state), s),
            [SERVICE_NAME], tls.server() if tls else None)
        # The advertised port is known only once the server is bound (port 0 in tests).
        identity = WorkerIdentity(w.advertise_address or f"{w.host}:{server.port}", w.device, w.base_model,
                                  w.max_num_seqs)
        registry = RegistryClient(channel, identity, lambda: worker_stats(engine),
                                  lambda: engine.stats().adapters.placements, engine.apply_orders)
        heartbeat = asyncio.create_task(registry.run(stop, config.registry.heartbeat_interval_ms))
        cpu_lora_health = asyncio.create_task(report_cpu_lora_health(server.health, engine.stats, stop))
        try:
            await stop.wait()
        finally:
            log.info("shutting down")
            await server.stop()
            engine.stop()
            await heartbeat
            await cpu_lora_health


CPU_LORA_HEALTH_SERVICE = "tessera.v1.CpuLoraWorkers"


async def report_cpu_lora_health(servicer: health.aio.HealthServicer, stats: Callable[[], EngineStats],
                                 stop: asyncio.Event, interval_s: float = 1.0) -> None:
    """Keep the standard health service's CPU_LORA_HEALTH_SERVICE status current: SERVING while every
    configured CPU LoRA worker answers jobs (a probe can tell a worker whose CPU assistance is down);
    not reported without CPU LoRA workers."""
    if not stats().cpu_lora.workers:  # configured at start: none now, none later
        return
    while not stop.is_set():
        cpu_lora = stats().cpu_lora
        await servicer.set(CPU_LORA_HEALTH_SERVICE, HealthCheckResponse.SERVING if cpu_lora.ready == cpu_lora.workers
                           else HealthCheckResponse.NOT_SERVING)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), interval_s)


def serve(config: TesseraConfig) -> None:
    setup_logging("worker", config.log_level)
    tls = cluster_credentials(config, "worker")  # first: a missing certificate fails before the model loads
    serving_device(config.worker.device)  # and a device this process cannot use, before the registry is asked
    run_until_signalled(lambda stop: _main(config, tls, stop))
