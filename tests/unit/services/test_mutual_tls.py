"""Mutual TLS on the internal gRPC ports: the real Registry service and a WorkerService on loopback
servers secured as the roles secure them, dialled by a fake worker or client with no cluster
certificate, with one from another cluster's CA, and with the right ones."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from gateway.registry_cache import RegistryCache
from gateway.worker_client import WorkerClient
from registry.grpc_service import SERVICE_NAME, add_registry_service
from registry.store import RegistryStore
from services.common.config import TesseraConfig, load_config
from services.common.errors import Unavailable
from services.common.grpc_server import GrpcServer, start_grpc_server
from services.common.tls import RoleCredentials, load_role_credentials, tls_paths
from services.common.tls_issue import ensure_cluster_certs
from tessera.v1 import common_pb2, registry_pb2, registry_pb2_grpc, worker_pb2, worker_pb2_grpc

REGISTER = registry_pb2.RegisterWorkerRequest(address="127.0.0.1:1", device="cpu", base_model="m", capacity=4)


def cluster(home: Path) -> TesseraConfig:
    config = load_config(environ={"TESSERA_HOME": str(home)})
    ensure_cluster_certs(config)
    return config


@pytest.fixture
def ours(tmp_path: Path) -> TesseraConfig:
    return cluster(tmp_path / "ours")


@pytest.fixture
def theirs(tmp_path: Path) -> TesseraConfig:
    return cluster(tmp_path / "theirs")


def creds(config: TesseraConfig, role: str) -> RoleCredentials:
    return load_role_credentials(config, role)


def no_client_certificate(config: TesseraConfig) -> grpc.ChannelCredentials:
    """A proper TLS client that trusts the cluster's CA but has no certificate of its own."""
    return grpc.ssl_channel_credentials(root_certificates=tls_paths(config).ca.read_bytes())


def foreign_certificate(config: TesseraConfig, foreign: TesseraConfig) -> grpc.ChannelCredentials:
    """Trusts `config`'s CA, presents a worker certificate that `foreign`'s CA issued."""
    other = creds(foreign, "worker")
    return grpc.ssl_channel_credentials(root_certificates=tls_paths(config).ca.read_bytes(),
                                        private_key=other.key, certificate_chain=other.cert)


def channel(address: str, credentials: grpc.ChannelCredentials | None) -> grpc.aio.Channel:
    if credentials is None:
        return grpc.aio.insecure_channel(address)
    return grpc.aio.secure_channel(address, credentials)


async def start_registry(config: TesseraConfig, served_as: TesseraConfig) -> tuple[GrpcServer, RegistryStore]:
    """The real Registry service over `config`'s store, presenting `served_as`'s registry certificate."""
    store = RegistryStore.from_config(config)
    server = await start_grpc_server("127.0.0.1:0", add_registry_service(store, heartbeat_interval_ms=500),
                                     [SERVICE_NAME], creds(served_as, "registry").server())
    return server, store


async def refused(call) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    return err.value.code()


def test_a_fake_worker_without_a_cluster_certificate_cannot_register_or_heartbeat(ours: TesseraConfig) -> None:
    async def main() -> None:
        server, store = await start_registry(ours, ours)
        address = f"127.0.0.1:{server.port}"
        try:
            for credentials in (None, no_client_certificate(ours)):
                async with channel(address, credentials) as ch:
                    stub = registry_pb2_grpc.RegistryStub(ch)
                    assert await refused(stub.RegisterWorker(REGISTER, timeout=5)) == grpc.StatusCode.UNAVAILABLE
                    assert await refused(stub.Heartbeat(registry_pb2.HeartbeatRequest(worker_id="w1"),
                                                        timeout=5)) == grpc.StatusCode.UNAVAILABLE
                    assert await refused(stub.ListWorkers(registry_pb2.ListWorkersRequest(),
                                                          timeout=5)) == grpc.StatusCode.UNAVAILABLE
            assert store.list_workers() == []
        finally:
            await server.stop(0)
            store.close()

    asyncio.run(main())


def test_a_fake_worker_with_a_certificate_from_another_ca_cannot_register(ours: TesseraConfig,
                                                                          theirs: TesseraConfig) -> None:
    async def main() -> None:
        server, store = await start_registry(ours, ours)
        address = f"127.0.0.1:{server.port}"
        try:
            for credentials in (foreign_certificate(ours, theirs), creds(theirs, "worker").channel()):
                async with channel(address, credentials) as ch:
                    stub = registry_pb2_grpc.RegistryStub(ch)
                    assert await refused(stub.RegisterWorker(REGISTER, timeout=5)) == grpc.StatusCode.UNAVAILABLE
            assert store.list_workers() == []
        finally:
            await server.stop(0)
            store.close()

    asyncio.run(main())


def test_with_the_cluster_certificates_workers_register_and_the_gateway_reads(ours: TesseraConfig) -> None:
    async def main() -> None:
        server, store = await start_registry(ours, ours)
        address = f"127.0.0.1:{server.port}"
        cache = RegistryCache(address, refresh_s=60, credentials=creds(ours, "gateway").channel())
        try:
            async with channel(address, creds(ours, "worker").channel()) as ch:
                stub = registry_pb2_grpc.RegistryStub(ch)
                worker_id = (await stub.RegisterWorker(REGISTER, timeout=5)).worker_id
                beat = await stub.Heartbeat(registry_pb2.HeartbeatRequest(worker_id=worker_id), timeout=5)
                assert beat.known
            assert await cache.refresh()
            assert [w.address for w in (await cache.snapshot()).workers] == [REGISTER.address]
        finally:
            await cache.close()
            await server.stop(0)
            store.close()

    asyncio.run(main())


def test_only_the_workers_certificate_registers_heartbeats_and_reports_placements(ours: TesseraConfig) -> None:
    """Another role's cluster certificate reads the registry but cannot pose as a worker."""
    placements = registry_pb2.ReportPlacementsRequest(worker_id="w1")

    async def main() -> None:
        server, store = await start_registry(ours, ours)
        address = f"127.0.0.1:{server.port}"
        try:
            for role in ("gateway", "registry"):
                async with channel(address, creds(ours, role).channel()) as ch:
                    stub = registry_pb2_grpc.RegistryStub(ch)
                    for call in (stub.RegisterWorker(REGISTER, timeout=5),
                                 stub.Heartbeat(registry_pb2.HeartbeatRequest(worker_id="w1"), timeout=5),
                                 stub.ReportPlacements(placements, timeout=5)):
                        with pytest.raises(grpc.aio.AioRpcError) as err:
                            await call
                        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, role
                        assert f"tessera-{role}" in err.value.details() and "tessera-worker" in err.value.details()
                    assert (await stub.ListWorkers(registry_pb2.ListWorkersRequest(), timeout=5)).workers == []
            assert store.list_workers() == []
            async with channel(address, creds(ours, "worker").channel()) as ch:
                stub = registry_pb2_grpc.RegistryStub(ch)
                worker_id = (await stub.RegisterWorker(REGISTER, timeout=5)).worker_id
                assert (await stub.Heartbeat(registry_pb2.HeartbeatRequest(worker_id=worker_id), timeout=5)).known
                await stub.ReportPlacements(registry_pb2.ReportPlacementsRequest(worker_id=worker_id), timeout=5)
            assert [w.address for w in store.list_workers()] == [REGISTER.address]
        finally:
            await server.stop(0)
            store.close()

    asyncio.run(main())


def test_a_worker_refuses_a_registry_with_another_clusters_certificate(ours: TesseraConfig,
                                                                        theirs: TesseraConfig) -> None:
    """Roles verify each other: an impostor registry (its own CA) never sees our worker's registration."""
    async def main() -> None:
        server, store = await start_registry(theirs, theirs)
        try:
            async with channel(f"127.0.0.1:{server.port}", creds(ours, "worker").channel()) as ch:
                stub = registry_pb2_grpc.RegistryStub(ch)
                assert await refused(stub.RegisterWorker(REGISTER, timeout=5)) == grpc.StatusCode.UNAVAILABLE
            assert store.list_workers() == []
        finally:
            await server.stop(0)
            store.close()

    asyncio.run(main())


class RecordingWorker(worker_pb2_grpc.WorkerServiceServicer):
    """Answers Generate with one final message and counts the calls that got through."""

    def __init__(self) -> None:
        self.calls = 0

    async def Generate(self, request: worker_pb2.WorkerGenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[common_pb2.GenerateResponse]:
        self.calls += 1
        yield common_pb2.GenerateResponse(request_id=request.request_id, final=common_pb2.Completion(text="ok"))


def test_only_a_cluster_certificate_reaches_a_workers_generate(ours: TesseraConfig, theirs: TesseraConfig) -> None:
    worker = RecordingWorker()
    request = worker_pb2.WorkerGenerateRequest(request_id="r1", base_model="m", text="hi")

    async def main() -> None:
        server = await start_grpc_server(
            "127.0.0.1:0", lambda s: worker_pb2_grpc.add_WorkerServiceServicer_to_server(worker, s),
            ["tessera.v1.WorkerService"], creds(ours, "worker").server())
        address = f"127.0.0.1:{server.port}"
        try:
            for credentials in (None, no_client_certificate(ours), foreign_certificate(ours, theirs)):
                async with channel(address, credentials) as ch:
                    call = worker_pb2_grpc.WorkerServiceStub(ch).Generate(request, timeout=5)
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await call.read()
                    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert worker.calls == 0
            # The gateway's client with the gateway's certificate gets through; an impostor gateway does not.
            gateway = WorkerClient(request_timeout_s=5, credentials=creds(ours, "gateway").channel())
            impostor = WorkerClient(request_timeout_s=5, credentials=creds(theirs, "gateway").channel())
            try:
                assert [r.final.text async for r in gateway.generate(address, request)] == ["ok"]
                with pytest.raises(Unavailable):
                    [r async for r in impostor.generate(address, request)]
            finally:
                await gateway.close()
                await impostor.close()
            assert worker.calls == 1
        finally:
            await server.stop(0)

    asyncio.run(main())
