"""The registry role's process: admin REST API and gRPC Registry service on one event loop, metrics."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets

from sqlalchemy.engine import make_url

from registry.app import create_admin_app, error_body
from registry.catalog_relay import CatalogRelay
from registry.metrics import PLACEMENT_MOVES, PLANNED_ADAPTERS, PLANNED_GPU_REPLICAS, PLANNER_LEASE
from registry.placement_planner import PlacementPlanner
from registry.planner_lease import PlannerLease
from registry.grpc_service import SERVICE_NAME, add_registry_service
from registry.store import RegistryStore
from services.common.config import ConfigError, RegistryConfig, TesseraConfig
from policy.placement import PlanLimits
from services.common.grpc_server import start_grpc_server
from services.common.http_server import HttpLimits, LoopHttpServer
from services.common.logs import setup_logging
from services.common.metrics import start_metrics_server
from services.common.runtime import run_until_signalled
from services.common.tls import cluster_credentials

log = logging.getLogger(__name__)

# The admin API takes small JSON bodies (names and paths); the other limits are the gateway's.
ADMIN_LIMITS = HttpLimits(max_body_bytes=1024 * 1024)


def resolve_admin_api_key(config: TesseraConfig) -> str:
    """The configured admin API key, else the one in <home>/admin_api_key (created 0600 on first use)."""
    if config.registry.admin_api_key:
        return config.registry.admin_api_key
    path = config.admin_api_key_path
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        # O_EXCL: two processes starting at once agree on one key; 0600 from the first byte.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        key = path.read_text().strip()
        if not key:
            raise RuntimeError(f"{path} is empty; delete it to create a new admin API key")
        return key
    key = secrets.token_urlsafe(32)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    log.info("created admin API key in %s", path)
    return key


async def _plan_placements(planner: PlacementPlanner, lease: PlannerLease, interval_s: float,
                           stop: asyncio.Event) -> None:
    """A placement plan of every base model each interval (the first after one interval of requests), while
    this replica holds the planner's lease (given back at the end)."""
    try:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval_s)
            if stop.is_set():
                return
            try:
                leading = await asyncio.to_thread(lease.held)
                PLANNER_LEASE.set(leading)
                if not leading:
                    continue
                summaries = await asyncio.to_thread(planner.plan_all)
            except Exception:  # noqa: BLE001 - a failed pass (the database away) is retried at the next
                log.exception("placement planning failed; trying again in %.0f s", interval_s)
                continue
            for summary in summaries:
                PLANNED_ADAPTERS.labels(summary.base_model, "gpu").set(summary.gpu_adapters)
                PLANNED_ADAPTERS.labels(summary.base_model, "host").set(summary.host_adapters)
                PLANNED_GPU_REPLICAS.labels(summary.base_model).set(summary.gpu_replicas)
                PLACEMENT_MOVES.labels(summary.base_model).inc(summary.moves)
    finally:
        await asyncio.to_thread(lease.close)


def _planner(config: TesseraConfig, store: RegistryStore) -> PlacementPlanner | None:
    settings = config.registry
    if settings.placement_interval_s < 0 or settings.placement_half_life_s <= 0 or not (
            0 <= settings.placement_gpu_share <= 1 and 0 <= settings.placement_host_share <= 1
            and settings.placement_replica_factor > 0):
        raise ConfigError("registry.placement_*: interval_s >= 0, half_life_s > 0, shares in [0, 1], "
                          "replica_factor > 0")
    if not settings.placement_interval_s:
        store.clear_planned_placements()  # an earlier run's plan must not outlive the planner
        return None
    limits = PlanLimits(settings.placement_gpu_share, settings.placement_host_share,
                        replica_factor=settings.placement_replica_factor)
    return PlacementPlanner(store, limits, settings.placement_half_life_s)


async def _housekeeping(store: RegistryStore, settings: RegistryConfig, stop: asyncio.Event) -> None:
    """At start, then every quarter of the shorter period: remove deleted adapters' files once their grace
    has passed, and forget workers silent past their expiry."""
    interval_s = max(1.0, min(settings.deleted_files_grace_s, settings.worker_expiry_s) / 4)
    while not stop.is_set():
        for directory in await asyncio.to_thread(store.sweep_deleted_files):
            log.info("removed the stored files of deleted adapters at %s", directory)
        for worker in await asyncio.to_thread(store.expire_workers):
            log.info("forgot worker %s at %s (%s), silent for %.0f s", worker.worker_id, worker.address,
                     worker.base_model, settings.worker_expiry_s)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), interval_s)


def serve(config: TesseraConfig) -> None:
    setup_logging("registry", config.log_level)
    tls = cluster_credentials(config, "registry")  # first: a missing certificate fails before anything binds
    settings = config.registry
    if not settings.worker_expiry_s >= settings.worker_timeout_s > 0:
        raise ConfigError(f"registry.worker_expiry_s ({settings.worker_expiry_s}) must be at least "
                          f"registry.worker_timeout_s ({settings.worker_timeout_s}), which must be positive")
    store = RegistryStore.from_config(config)
    planner = _planner(config, store)
    start_metrics_server(settings.host, settings.metrics_port)
    admin_app = create_admin_app(store, resolve_admin_api_key(config))

    async def main(stop: asyncio.Event) -> None:
        # uvicorn on this loop, as the gateway's REST port: idle or slow clients hold no thread and
        # are closed after HttpLimits' timeouts; Flask handlers run on `http_threads` threads.
        admin = await LoopHttpServer.start(admin_app, settings.host, settings.admin_port,
                                           threads=settings.http_threads, limits=ADMIN_LIMITS, error_body=error_body)
        grpc_server = await start_grpc_server(
            f"{settings.host}:{settings.grpc_port}",
            add_registry_service(store, settings.heartbeat_interval_ms), [SERVICE_NAME],
            tls.server() if tls else None)
        log.info("registry ready: gRPC %s:%s, admin API http://%s:%s/admin/v1",
                 settings.host, grpc_server.port, settings.host, admin.port)
        sweeping = asyncio.create_task(_housekeeping(store, settings, stop))
        planning = asyncio.create_task(_plan_placements(
            planner, PlannerLease(config.database_url), settings.placement_interval_s, stop)) if planner else None
        await stop.wait()
        await sweeping
        if planning:
            await planning
        await grpc_server.stop()
        await admin.close()

    relay = CatalogRelay(config.database_url, store.changes, store.replica) \
        if make_url(config.database_url).get_backend_name() == "postgresql" else None
    if relay:
        relay.start()
    try:
        run_until_signalled(main)
    finally:
        if relay:
            relay.close()
        store.close()
