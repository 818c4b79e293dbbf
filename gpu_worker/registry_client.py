"""The worker's side of the registry: find the checkpoint, register, heartbeat, report placements.

Every call retries with capped exponential backoff while the registry is down; a heartbeat answered
`known=False` (the registry restarted or expired us) triggers a fresh registration, after which
the full placement set is reported again. A heartbeat tells the registry every adapter version the
worker holds; its answer says which to retire (deleted, or registered again with other weights) and
carries the operators' pins and preloads for this worker, which go to the engine (`on_orders`).
Placements report each adapter's real tier, whether it is loading and whether it is pinned.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import grpc

from policy.residency_edge import AdapterPlacement
from gpu_worker.lora.loader import AdapterRef
from policy.placement_orders import PlacementOrders, Preload
from policy.adapter_tiers import Tier
from services.common.task_heads import task_head_from_record
from tessera.v1 import common_pb2, registry_pb2, registry_pb2_grpc

log = logging.getLogger(__name__)

T = TypeVar("T")
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.NOT_FOUND)
RPC_TIMEOUT_S = 5.0
MAX_BACKOFF_S = 5.0
TIER_TO_PROTO = {Tier.GPU: common_pb2.TIER_GPU, Tier.HOST: common_pb2.TIER_HOST, Tier.DISK: common_pb2.TIER_DISK}


@dataclass(frozen=True)
class WorkerIdentity:
    address: str       # host:port others dial
    device: str
    base_model: str
    capacity: int


async def retry_rpc(what: str, call: Callable[[], Awaitable[T]], stop: asyncio.Event,
                    max_backoff_s: float = MAX_BACKOFF_S) -> T | None:
    """Run `call` until it succeeds (None if `stop` is set first); NOT_FOUND counts as 'not yet'
    (the launcher may register the base model after the worker starts)."""
    delay = 0.1
    while not stop.is_set():
        try:
            return await call()
        except grpc.aio.AioRpcError as err:
            if err.code() not in RETRYABLE:
                raise
            log.warning("%s: %s (%s); retrying in %.1fs", what, err.code().name, err.details(), delay)
        try:
            await asyncio.wait_for(stop.wait(), timeout=delay)
        except TimeoutError:
            pass
        delay = min(delay * 2, max_backoff_s)
    return None


async def fetch_base_model(channel: grpc.aio.Channel, name: str, stop: asyncio.Event) -> common_pb2.BaseModel | None:
    stub = registry_pb2_grpc.RegistryStub(channel)
    return await retry_rpc(f"GetBaseModel({name})", lambda: stub.GetBaseModel(
        registry_pb2.GetBaseModelRequest(name=name), timeout=RPC_TIMEOUT_S), stop)


def adapter_ref(adapter: common_pb2.Adapter) -> AdapterRef:
    """What the registry says about an adapter, as the worker's adapter tiers take it."""
    return AdapterRef(adapter.name, adapter.base_model, adapter.rank, adapter.sha256, adapter.storage_path,
                      adapter.created_unix_ms, task_head_from_record(adapter.task_head_json), adapter.tower_lora_params)


def placement_orders(reply: registry_pb2.HeartbeatResponse) -> PlacementOrders:
    return PlacementOrders(retire=tuple((v.name, v.sha256) for v in reply.retire),
                           pins=tuple(adapter_ref(p.adapter) for p in reply.placements if p.pin),
                           preloads=tuple(Preload(adapter_ref(p.adapter), p.expected_rate) for p in reply.placements
                                          if not (p.pin or p.host_only)),
                           host_preloads=tuple(Preload(adapter_ref(p.adapter), p.expected_rate)
                                               for p in reply.placements if p.host_only and not p.pin))


class RegistryClient:
    def __init__(self, channel: grpc.aio.Channel, identity: WorkerIdentity,
                 stats: Callable[[], common_pb2.WorkerStats], placements: Callable[[], Sequence[AdapterPlacement]],
                 on_orders: Callable[[PlacementOrders], None]) -> None:
        """`placements`: every adapter version held, under each of its names (AdapterTierStats.placements)."""
        self._stub = registry_pb2_grpc.RegistryStub(channel)
        self._identity = identity
        self._stats = stats
        self._placements = placements
        self._on_orders = on_orders
        self.worker_id = ""

    async def _register(self, stop: asyncio.Event) -> int | None:
        i = self._identity
        reply = await retry_rpc("RegisterWorker", lambda: self._stub.RegisterWorker(registry_pb2.RegisterWorkerRequest(
            address=i.address, device=i.device, base_model=i.base_model, capacity=i.capacity),
            timeout=RPC_TIMEOUT_S), stop)
        if reply is None:
            return None
        self.worker_id = reply.worker_id
        log.info("registered as worker %s (%s)", self.worker_id, i.address)
        return reply.heartbeat_interval_ms

    async def run(self, stop: asyncio.Event, default_interval_ms: int) -> None:
        """Register, then heartbeat and report placements until `stop` is set."""
        interval_ms = await self._register(stop)
        reported: tuple[AdapterPlacement, ...] | None = None
        while interval_ms is not None and not stop.is_set():
            stats, held = self._stats(), tuple(self._placements())
            try:
                reply = await self._stub.Heartbeat(registry_pb2.HeartbeatRequest(
                    worker_id=self.worker_id, stats=stats,
                    adapters=[registry_pb2.AdapterVersion(name=p.name, sha256=p.sha256) for p in held]),
                    timeout=RPC_TIMEOUT_S)
                if not reply.known:
                    log.warning("registry does not know worker %s; registering again", self.worker_id)
                    interval_ms, reported = await self._register(stop), None
                    continue
                self._on_orders(placement_orders(reply))
                newest = tuple(p for p in held if p.newest)  # what a new request for each name finds
                if newest != reported:
                    await self._stub.ReportPlacements(registry_pb2.ReportPlacementsRequest(
                        worker_id=self.worker_id, placements=[
                            common_pb2.Placement(adapter=p.name, worker_id=self.worker_id, tier=TIER_TO_PROTO[p.tier],
                                                 loading=p.loading, pinned=p.pinned)
                            for p in newest]), timeout=RPC_TIMEOUT_S)
                    reported = newest
            except grpc.aio.AioRpcError as err:
                log.warning("heartbeat to the registry failed: %s", err.code().name)
            try:
                await asyncio.wait_for(stop.wait(), timeout=(interval_ms or default_interval_ms) / 1000)
            except TimeoutError:
                pass
