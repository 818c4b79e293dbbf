"""RegistryClient against a fake Registry servicer on a real grpc.aio server: lookup, registration,
heartbeats that list the versions held and bring back the registry's orders, placements by real tier."""

from __future__ import annotations

import asyncio

import grpc

from policy.residency_edge import AdapterPlacement
from gpu_worker.lora.loader import AdapterRef
from policy.placement_orders import PlacementOrders, Preload
from gpu_worker.registry_client import RegistryClient, WorkerIdentity, fetch_base_model
from services.common.grpc_server import start_grpc_server
from policy.adapter_tiers import Tier
from tessera.v1 import common_pb2, registry_pb2, registry_pb2_grpc


class FakeRegistry(registry_pb2_grpc.RegistryServicer):
    def __init__(self):
        self.registrations = []
        self.heartbeats = 0
        self.held = []
        self.placements = []
        self.lookups = 0

    async def GetBaseModel(self, request, context):
        self.lookups += 1
        if self.lookups == 1:  # not registered yet on the first try
            await context.abort(grpc.StatusCode.NOT_FOUND, "no such base model")
        return common_pb2.BaseModel(name=request.name, path="/models/x")

    async def RegisterWorker(self, request, context):
        self.registrations.append(request.address)
        return registry_pb2.RegisterWorkerResponse(worker_id=f"w{len(self.registrations)}", heartbeat_interval_ms=20)

    async def Heartbeat(self, request, context):
        self.heartbeats += 1
        self.held.append([(v.name, v.sha256) for v in request.adapters])
        if self.heartbeats == 3:
            return registry_pb2.HeartbeatResponse(known=False)  # "restarted" once
        return registry_pb2.HeartbeatResponse(
            known=True, retire=[registry_pb2.AdapterVersion(name="old", sha256="d0")],
            placements=[registry_pb2.PlacementOrder(adapter=PINNED, pin=True),
                        registry_pb2.PlacementOrder(adapter=PRELOADED, pin=False),
                        registry_pb2.PlacementOrder(adapter=WARM, host_only=True, expected_rate=0.5)])

    async def ReportPlacements(self, request, context):
        self.placements.append((request.worker_id, [(p.adapter, p.tier, p.loading, p.pinned)
                                                    for p in request.placements]))
        return registry_pb2.ReportPlacementsResponse()


PINNED = common_pb2.Adapter(name="p", base_model="m", rank=8, sha256="d1", storage_path="/store/d1")
PRELOADED = common_pb2.Adapter(name="q", base_model="m", rank=16, sha256="d2", storage_path="/store/d2")
WARM = common_pb2.Adapter(name="w", base_model="m", rank=8, sha256="d3", storage_path="/store/d3")


def test_lookup_register_heartbeat_reregister_and_placements():
    fake = FakeRegistry()
    held = [AdapterPlacement("demo-r8", "d8", Tier.GPU, loading=False, pinned=True, newest=True),
            AdapterPlacement("demo-r8", "d7", Tier.GPU, loading=False, pinned=False, newest=False)]
    orders: list[PlacementOrders] = []

    async def main():
        server = await start_grpc_server(
            "127.0.0.1:0", lambda s: registry_pb2_grpc.add_RegistryServicer_to_server(fake, s), ["tessera.v1.Registry"])
        stop = asyncio.Event()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            base = await fetch_base_model(channel, "m", stop)
            client = RegistryClient(channel, WorkerIdentity("127.0.0.1:1", "cpu", "m", 4),
                                    lambda: common_pb2.WorkerStats(running_requests=1), lambda: held, orders.append)
            task = asyncio.create_task(client.run(stop, 1000))
            while fake.heartbeats < 6:
                await asyncio.sleep(0.01)
            held.append(AdapterPlacement("demo-r16", "d16", Tier.DISK, loading=True, pinned=False, newest=True))
            while len(fake.placements) < 3:
                await asyncio.sleep(0.01)
            stop.set()
            await task
        await server.stop(0)
        return base

    base = asyncio.run(main())
    assert base.path == "/models/x" and fake.lookups == 2
    assert fake.registrations == ["127.0.0.1:1", "127.0.0.1:1"]
    # Only the newest version of each name is a placement; every version held is listed to the registry.
    r8 = ("demo-r8", common_pb2.TIER_GPU, False, True)
    assert fake.placements == [("w1", [r8]), ("w2", [r8]), ("w2", [r8, ("demo-r16", common_pb2.TIER_DISK, True, False)])]
    assert fake.held[0] == [("demo-r8", "d8"), ("demo-r8", "d7")]
    assert fake.held[-1] == [("demo-r8", "d8"), ("demo-r8", "d7"), ("demo-r16", "d16")]
    assert len(orders) == fake.heartbeats - 1  # every known heartbeat's answer reaches the engine
    assert orders[0] == PlacementOrders(retire=(("old", "d0"),), pins=(AdapterRef("p", "m", 8, "d1", "/store/d1"),),
                                        preloads=(Preload(AdapterRef("q", "m", 16, "d2", "/store/d2")),),
                                        host_preloads=(Preload(AdapterRef("w", "m", 8, "d3", "/store/d3"), 0.5),))
