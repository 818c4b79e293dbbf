"""The gateway process: registry cache, core, gRPC Inference server and REST server on one loop.

The event loop (main thread) runs the core, the registry cache refresh and the grpc.aio
server, and the REST server (uvicorn, services/common/http_server.py): its connections and streamed
answers live on the loop, Flask handlers run on a small thread pool and reach the core through CoreBridge.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from pathlib import Path

from services.common.config import ConfigError, GatewayConfig, TesseraConfig
from services.common.grpc_server import GrpcServer, start_grpc_server
from services.common.http_server import LoopHttpServer
from services.common.logs import setup_logging
from services.common.metrics import start_metrics_server
from services.common.runtime import run_until_signalled
from policy.perf_model import PERF_MODELS_DIR, load_perf_models
from services.common.tls import cluster_credentials, gateway_public_credentials
from tessera.v1 import inference_pb2_grpc

from gateway.admission import Admission
from gateway.api_keys import ApiKeyInterceptor, ApiKeys
from gateway.app import start_http_server
from gateway.bridge import CoreBridge
from gateway.core import GatewayCore
from gateway.grpc_api import SERVICE_NAME, InferenceServicer
from gateway.registry_cache import RegistryCache
from gateway.router import NEEDS_PERF_MODELS, Router, build_policy
from policy.routing.worker_state import WorkerStateTable
from gateway.state_feed import StateFeed
from gateway.worker_client import WorkerClient

log = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class Gateway:
    """A started gateway; `close()` stops it in the reverse order of `start_gateway`."""

    core: GatewayCore
    cache: RegistryCache
    feed: StateFeed
    workers: WorkerClient
    grpc_server: GrpcServer
    http_server: LoopHttpServer

    @property
    def grpc_port(self) -> int:
        return self.grpc_server.port

    @property
    def http_port(self) -> int:
        return self.http_server.port

    async def close(self) -> None:
        await self.http_server.close()
        await self.grpc_server.stop()
        await self.feed.close()
        await self.workers.close()
        await self.cache.close()


async def start_gateway(config: TesseraConfig) -> Gateway:
    """Start everything on the running loop (ports 0 pick free ones; see Gateway.*_port)."""
    gw = config.gateway
    check_routing_config(gw)
    models = load_perf_models(Path(gw.perf_models_dir) if gw.perf_models_dir else PERF_MODELS_DIR)
    policy = build_policy(gw.routing_policy, models)
    # The gateway is a client of the registry and the workers (its certificate on both channels);
    # nothing inside the cluster calls it, so its one gRPC port is the public one.
    tls = cluster_credentials(config, "gateway")
    public_tls = gateway_public_credentials(config)
    internal = tls.channel() if tls else None
    cache = RegistryCache(gw.registry_address, gw.metadata_refresh_s, credentials=internal)
    await cache.start()
    workers = WorkerClient(gw.request_timeout_s, credentials=internal)
    router = Router(policy, WorkerStateTable(time.monotonic, gw.state_stale_s))
    priced = gw.routing_policy in NEEDS_PERF_MODELS
    feed = StateFeed(workers, router.table, gw.state_interval_ms, router.tightest_tpot_slo_s,
                     models if priced else None)
    log.info("routing with policy %s; perf models so far: %s (workers report theirs)", policy.name,
             ", ".join(sorted(models)) or "none")
    core = GatewayCore(gw, cache, Admission(gw.max_queued_per_model), router, feed, workers)
    grpc_server = await start_grpc_server(
        f"{gw.host}:{gw.grpc_port}",
        lambda server: inference_pb2_grpc.add_InferenceServicer_to_server(InferenceServicer(core), server),
        [SERVICE_NAME], public_tls,
        # The same client keys as REST; the health service stays open for probes.
        interceptors=[ApiKeyInterceptor(ApiKeys(gw.api_keys))] if gw.api_keys else [])
    bridge = CoreBridge(core, asyncio.get_running_loop(), gw.request_timeout_s)
    http_server = await start_http_server(bridge, gw)
    return Gateway(core, cache, feed, workers, grpc_server, http_server)


def check_routing_config(gw: GatewayConfig) -> None:
    if not 10 <= gw.state_interval_ms <= 100:
        raise ConfigError(f"gateway.state_interval_ms must be between 10 and 100, got {gw.state_interval_ms}")
    if gw.state_stale_s <= 2 * gw.state_interval_ms / 1e3:
        raise ConfigError(f"gateway.state_stale_s ({gw.state_stale_s}) must exceed two state intervals "
                          f"({2 * gw.state_interval_ms} ms)")
    for key in ("default_tpot_slo_ms", "default_ttft_slo_ms", "late_worker_wait_s"):
        if not getattr(gw, key) > 0:
            raise ConfigError(f"gateway.{key} must be positive, got {getattr(gw, key)}")
    if gw.max_queued_per_model < 1:
        raise ConfigError(f"gateway.max_queued_per_model must be >= 1, got {gw.max_queued_per_model}")


def serve(config: TesseraConfig) -> None:
    """Run the gateway until SIGINT/SIGTERM."""
    setup_logging("gateway", config.log_level)
    start_metrics_server(config.gateway.host, config.gateway.metrics_port)

    async def main(stop: asyncio.Event) -> None:
        gateway = await start_gateway(config)
        log.info("gateway ready: REST on port %s, gRPC on port %s, registry %s",
                 gateway.http_port, gateway.grpc_port, config.gateway.registry_address)
        await stop.wait()
        log.info("gateway shutting down")
        await gateway.close()

    run_until_signalled(main)
