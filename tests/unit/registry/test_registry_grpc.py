import asyncio
from pathlib import Path

import grpc
import pytest

from registry.grpc_service import SERVICE_NAME, add_registry_service
from registry.store import RegistryStore
from services.common.grpc_server import start_grpc_server
from services.common.task_heads import task_head_from_record
from tessera.v1 import common_pb2, registry_pb2, registry_pb2_grpc

from .conftest import BASE_MODEL


async def _exercise(store: RegistryStore) -> None:
    server = await start_grpc_server("127.0.0.1:0", add_registry_service(store, heartbeat_interval_ms=500), [SERVICE_NAME])
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = registry_pb2_grpc.RegistryStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as missing:
                await stub.GetAdapter(registry_pb2.GetAdapterRequest(name="nope"))
            assert missing.value.code() == grpc.StatusCode.NOT_FOUND
            assert "nope" in missing.value.details()

            adapters = (await stub.ListAdapters(registry_pb2.ListAdaptersRequest(base_model=BASE_MODEL))).adapters
            assert [(a.name, a.rank, a.alpha, list(a.target_modules)) for a in adapters] == [
                ("qv", 2, 4.0, ["q_proj", "v_proj"]), ("sentiment", 4, 8.0, ["q_proj", "v_proj"])]
            # The head the registry derived from the files; "" for a plain LoRA adapter.
            head = task_head_from_record(adapters[1].task_head_json)
            assert head is not None and (head.kind, head.labels) == ("classifier", ("negative", "neutral", "positive"))
            assert adapters[0].task_head_json == ""
            base = await stub.GetBaseModel(registry_pb2.GetBaseModelRequest(name=BASE_MODEL))
            assert (base.architecture, base.max_context, base.vocab_size) == ("LlamaForCausalLM", 256, 128)

            registered = await stub.RegisterWorker(registry_pb2.RegisterWorkerRequest(
                address="127.0.0.1:7001", device="cpu", base_model=BASE_MODEL, capacity=8))
            assert registered.heartbeat_interval_ms == 500
            stats = common_pb2.WorkerStats(running_requests=2, running_ranks=[2, 0], resident_adapters=["qv"],
                                           free_kv_tokens=1 << 40)
            beat = await stub.Heartbeat(registry_pb2.HeartbeatRequest(worker_id=registered.worker_id, stats=stats))
            assert beat.known
            assert not (await stub.Heartbeat(registry_pb2.HeartbeatRequest(worker_id="unknown"))).known
            workers = (await stub.ListWorkers(registry_pb2.ListWorkersRequest(healthy_only=True))).workers
            assert [(w.worker_id, w.healthy) for w in workers] == [(registered.worker_id, True)]
            assert workers[0].stats == stats

            await stub.ReportPlacements(registry_pb2.ReportPlacementsRequest(
                worker_id=registered.worker_id,
                placements=[common_pb2.Placement(adapter="qv", tier=common_pb2.TIER_GPU)]))
            placements = (await stub.ListPlacements(registry_pb2.ListPlacementsRequest(adapter="qv"))).placements
            assert [(p.worker_id, p.tier) for p in placements] == [(registered.worker_id, common_pb2.TIER_GPU)]
            with pytest.raises(grpc.aio.AioRpcError) as bad:
                await stub.RegisterWorker(registry_pb2.RegisterWorkerRequest(
                    address="127.0.0.1:7002", device="cpu", base_model=BASE_MODEL, capacity=0))
            assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        await server.stop(grace_s=0)


def test_registry_service_over_grpc(store: RegistryStore, imports: Path) -> None:
    store.register_adapter("qv", BASE_MODEL, str(imports / "attn-qv"))
    store.register_adapter("sentiment", BASE_MODEL, str(imports / "seq-cls"))
    asyncio.run(_exercise(store))
