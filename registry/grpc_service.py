"""The tessera.v1.Registry gRPC service: a thin servicer over RegistryStore.

Store calls block on the database, so each runs in a thread (`asyncio.to_thread`)
and the event loop keeps serving other RPCs; domain errors become status codes
in services/common/grpc_server.py's interceptor. Any cluster certificate reads; only
the worker's registers a worker, heartbeats and reports placements (PERMISSION_DENIED
for the gateway's: services/common/peer_role.py). A heartbeat's answer carries what the
registry asks of that worker's adapter tiers (versions to retire, operators' pins and preloads);
WatchCatalog streams the catalog's changes to the gateways.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from registry.proto_records import (adapter_to_proto, base_model_to_proto, orders_to_proto, placement_from_proto,
                                    placement_to_proto, stats_to_dict, versions_from_proto, worker_to_proto)
from registry.store import RegistryStore
from services.common.grpc_server import Registrar
from services.common.peer_role import require_peer_role
from tessera.v1 import common_pb2, registry_pb2, registry_pb2_grpc

SERVICE_NAME = "tessera.v1.Registry"


class RegistryServicer(registry_pb2_grpc.RegistryServicer):
    def __init__(self, store: RegistryStore, heartbeat_interval_ms: int) -> None:
        self._store = store
        self._heartbeat_interval_ms = heartbeat_interval_ms

    async def GetBaseModel(self, request: registry_pb2.GetBaseModelRequest,
                           context: grpc.aio.ServicerContext) -> common_pb2.BaseModel:
        return base_model_to_proto(await asyncio.to_thread(self._store.get_base_model, request.name))

    async def ListBaseModels(self, request: registry_pb2.ListBaseModelsRequest,
                             context: grpc.aio.ServicerContext) -> registry_pb2.ListBaseModelsResponse:
        records = await asyncio.to_thread(self._store.list_base_models)
        return registry_pb2.ListBaseModelsResponse(base_models=[base_model_to_proto(r) for r in records])

    async def GetAdapter(self, request: registry_pb2.GetAdapterRequest,
                         context: grpc.aio.ServicerContext) -> common_pb2.Adapter:
        return adapter_to_proto(await asyncio.to_thread(self._store.get_adapter, request.name))

    async def ListAdapters(self, request: registry_pb2.ListAdaptersRequest,
                           context: grpc.aio.ServicerContext) -> registry_pb2.ListAdaptersResponse:
        records = await asyncio.to_thread(self._store.list_adapters, request.base_model or None)
        return registry_pb2.ListAdaptersResponse(adapters=[adapter_to_proto(r) for r in records])

    async def RegisterWorker(self, request: registry_pb2.RegisterWorkerRequest,
                             context: grpc.aio.ServicerContext) -> registry_pb2.RegisterWorkerResponse:
        require_peer_role(context, "worker")
        record = await asyncio.to_thread(
            self._store.register_worker, request.address, request.device, request.base_model, request.capacity)
        return registry_pb2.RegisterWorkerResponse(
            worker_id=record.worker_id, heartbeat_interval_ms=self._heartbeat_interval_ms)

    async def Heartbeat(self, request: registry_pb2.HeartbeatRequest,
                        context: grpc.aio.ServicerContext) -> registry_pb2.HeartbeatResponse:
        require_peer_role(context, "worker")
        if not await asyncio.to_thread(self._store.heartbeat, request.worker_id, stats_to_dict(request.stats)):
            return registry_pb2.HeartbeatResponse(known=False)
        orders = await asyncio.to_thread(self._store.worker_orders, request.worker_id,
                                         versions_from_proto(request.adapters))
        return orders_to_proto(orders)

    async def ListWorkers(self, request: registry_pb2.ListWorkersRequest,
                          context: grpc.aio.ServicerContext) -> registry_pb2.ListWorkersResponse:
        records = await asyncio.to_thread(self._store.list_workers, request.base_model or None, request.healthy_only)
        return registry_pb2.ListWorkersResponse(workers=[worker_to_proto(r) for r in records])

    async def ReportPlacements(self, request: registry_pb2.ReportPlacementsRequest,
                               context: grpc.aio.ServicerContext) -> registry_pb2.ReportPlacementsResponse:
        require_peer_role(context, "worker")
        placements = [placement_from_proto(p, request.worker_id) for p in request.placements]
        await asyncio.to_thread(self._store.replace_placements, request.worker_id, placements)
        return registry_pb2.ReportPlacementsResponse()

    async def ListPlacements(self, request: registry_pb2.ListPlacementsRequest,
                             context: grpc.aio.ServicerContext) -> registry_pb2.ListPlacementsResponse:
        records = await asyncio.to_thread(
            self._store.list_placements, request.adapter or None, request.worker_id or None)
        return registry_pb2.ListPlacementsResponse(placements=[placement_to_proto(r) for r in records])

    async def WatchCatalog(self, request: registry_pb2.WatchCatalogRequest,
                           context: grpc.aio.ServicerContext) -> AsyncIterator[registry_pb2.CatalogChange]:
        with self._store.changes.subscribe() as changes:
            yield registry_pb2.CatalogChange()  # subscribed: the watcher refreshes what it missed
            while True:
                try:
                    change = await changes.get()
                except asyncio.CancelledError:  # the server stops: the stream ends, with no traceback logged
                    return
                yield registry_pb2.CatalogChange(removed_adapters=change.removed_adapters)


def add_registry_service(store: RegistryStore, heartbeat_interval_ms: int) -> Registrar:
    """A services.common.grpc_server Registrar adding the Registry service."""
    servicer = RegistryServicer(store, heartbeat_interval_ms)
    return lambda server: registry_pb2_grpc.add_RegistryServicer_to_server(servicer, server)
