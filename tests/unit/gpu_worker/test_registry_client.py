"""RegistryClient against a fake Registry servicer on a real grpc.aio server."""

from __future__ import annotations

import asyncio

import grpc

from gpu_worker.registry_client import RegistryClient, WorkerIdentity, fetch_base_model
from services.common.grpc_server import start_grpc_server
from tessera.v1 import common_pb2, registry_pb2, registry_pb2_grpc


class FakeRegistry(registry_pb2_grpc.RegistryServicer):
    def __init__(self):
        self.registrations = []
        self.heartbeats = 0
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
        return registry_pb2.HeartbeatResponse(known=self.heartbeats != 3)  # "restarted" once

    async def ReportPlacements(self, request, context):
        self.placements.append((request.worker_id, [(p.adapter, p.tier) for p in request.placements]))
        return registry_pb2.ReportPlacementsResponse()


def test_lookup_register_heartbeat_reregister_and_placements():
    fake = FakeRegistry()
    resident = ["demo-r8"]

    async def main():
        server = await start_grpc_server(
            "127.0.0.1:0", lambda s: registry_pb2_grpc.add_RegistryServicer_to_server(fake, s), ["tessera.v1.Registry"])
        stop = asyncio.Event()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            base = await fetch_base_model(channel, "m", stop)
            client = RegistryClient(channel, WorkerIdentity("127.0.0.1:1", "cpu", "m", 4),
                                    lambda: common_pb2.WorkerStats(resident_adapters=resident))
            task = asyncio.create_task(client.run(stop, 1000))
            while fake.heartbeats < 6:
                await asyncio.sleep(0.01)
            resident.append("demo-r16")
            while len(fake.placements) < 3:
                await asyncio.sleep(0.01)
            stop.set()
            await task
        await server.stop(0)
        return base

    base = asyncio.run(main())
    assert base.path == "/models/x" and fake.lookups == 2
    assert fake.registrations == ["127.0.0.1:1", "127.0.0.1:1"]
    gpu = common_pb2.TIER_GPU
    assert fake.placements == [("w1", [("demo-r8", gpu)]), ("w2", [("demo-r8", gpu)]),
                               ("w2", [("demo-r8", gpu), ("demo-r16", gpu)])]
