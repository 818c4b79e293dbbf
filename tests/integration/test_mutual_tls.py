"""Mutual TLS in the running system (`tessera up`, TLS on by default): a process on loopback without
a cluster certificate, or with one from another CA, can neither pose as a worker to the registry nor
reach a worker's Generate and WatchState; nor can one with another role's cluster certificate (only
the worker's registers and heartbeats, only the gateway's calls a worker); clients reach the
gateway's public port as before."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from benchmarks.harness.live_system import REPO_ROOT, RunningSystem
from services.common.config import TesseraConfig, load_config
from services.common.grpc_server import check_health
from services.common.tls import load_role_credentials, tls_paths
from services.common.tls_issue import ensure_cluster_certs
from tessera.v1 import common_pb2, inference_pb2, inference_pb2_grpc, registry_pb2, registry_pb2_grpc, worker_pb2
from tessera.v1 import worker_pb2_grpc

pytestmark = pytest.mark.integration

FAKE_WORKER = "127.0.0.1:9"  # where a fake worker would have the gateway send prompts


@pytest.fixture(scope="module")
def other_cluster(tmp_path_factory: pytest.TempPathFactory) -> TesseraConfig:
    config = load_config(environ={"TESSERA_HOME": str(tmp_path_factory.mktemp("other-cluster"))})
    ensure_cluster_certs(config)
    return config


def outsiders(system: RunningSystem, other: TesseraConfig) -> dict[str, grpc.Channel]:
    """Channels of processes without this cluster's certificate (each trusts the CA where it can)."""
    ca = tls_paths(system.config).ca.read_bytes()
    foreign = load_role_credentials(other, "worker")
    return {
        "plaintext": None,
        "TLS, no client certificate": grpc.ssl_channel_credentials(root_certificates=ca),
        "another CA's certificate": grpc.ssl_channel_credentials(
            root_certificates=ca, private_key=foreign.key, certificate_chain=foreign.cert),
    }


def dial(address: str, credentials: grpc.ChannelCredentials | None) -> grpc.Channel:
    return grpc.insecure_channel(address) if credentials is None else grpc.secure_channel(address, credentials)


def test_the_registry_refuses_a_fake_worker_without_a_cluster_certificate(system: RunningSystem,
                                                                         other_cluster: TesseraConfig) -> None:
    register = registry_pb2.RegisterWorkerRequest(address=FAKE_WORKER, device="cpu",
                                                  base_model="tessera-demo-llama", capacity=32)
    for name, credentials in outsiders(system, other_cluster).items():
        with dial(system.registry_grpc, credentials) as channel:
            stub = registry_pb2_grpc.RegistryStub(channel)
            for call, request in ((stub.RegisterWorker, register),
                                  (stub.Heartbeat, registry_pb2.HeartbeatRequest(worker_id="w1")),
                                  (stub.ListAdapters, registry_pb2.ListAdaptersRequest())):
                with pytest.raises(grpc.RpcError) as err:
                    call(request, timeout=10)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE, name
    with system.internal_channel(system.registry_grpc) as channel:
        workers = registry_pb2_grpc.RegistryStub(channel).ListWorkers(registry_pb2.ListWorkersRequest(), timeout=10)
    assert FAKE_WORKER not in [w.address for w in workers.workers]
    assert system.worker_grpc in [w.address for w in workers.workers]


def test_a_worker_refuses_generate_and_watch_state_without_a_cluster_certificate(
        system: RunningSystem, other_cluster: TesseraConfig) -> None:
    generate = worker_pb2.WorkerGenerateRequest(request_id="outsider", base_model="tessera-demo-llama",
                                                text="hello", sampling=common_pb2.SamplingParams(max_tokens=2))
    for name, credentials in outsiders(system, other_cluster).items():
        with dial(system.worker_grpc, credentials) as channel:
            stub = worker_pb2_grpc.WorkerServiceStub(channel)
            for stream in (stub.Generate(generate, timeout=10),
                           stub.WatchState(worker_pb2.WatchStateRequest(interval_ms=50), timeout=10)):
                with pytest.raises(grpc.RpcError) as err:
                    next(stream)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE, name
    with system.internal_channel(system.worker_grpc) as channel:  # the gateway's certificate gets through
        replies = list(worker_pb2_grpc.WorkerServiceStub(channel).Generate(generate, timeout=60))
    assert replies[-1].WhichOneof("payload") == "final"


def role_channel(system: RunningSystem, address: str, role: str) -> grpc.Channel:
    return dial(address, load_role_credentials(system.config, role).channel())


def test_only_the_workers_certificate_registers_heartbeats_and_reports_placements(system: RunningSystem) -> None:
    register = registry_pb2.RegisterWorkerRequest(address=FAKE_WORKER, device="cpu",
                                                  base_model="tessera-demo-llama", capacity=32)
    with role_channel(system, system.registry_grpc, "gateway") as channel:
        stub = registry_pb2_grpc.RegistryStub(channel)
        for call, request in ((stub.RegisterWorker, register),
                              (stub.Heartbeat, registry_pb2.HeartbeatRequest(worker_id="w1")),
                              (stub.ReportPlacements, registry_pb2.ReportPlacementsRequest(worker_id="w1"))):
            with pytest.raises(grpc.RpcError) as err:
                call(request, timeout=10)
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, call
            assert "tessera-worker" in err.value.details() and "tessera-gateway" in err.value.details()
        workers = stub.ListWorkers(registry_pb2.ListWorkersRequest(), timeout=10).workers  # reads stay open
    assert FAKE_WORKER not in [w.address for w in workers]
    # The worker's certificate gets past the role check to the store, which answers each call on its
    # merits (requests that leave the running system as it is).
    with role_channel(system, system.registry_grpc, "worker") as channel:
        stub = registry_pb2_grpc.RegistryStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.RegisterWorker(registry_pb2.RegisterWorkerRequest(
                address=FAKE_WORKER, device="cpu", base_model="tessera-demo-llama", capacity=0), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "capacity" in err.value.details()
        assert not stub.Heartbeat(registry_pb2.HeartbeatRequest(worker_id="w1"), timeout=10).known
        with pytest.raises(grpc.RpcError) as err:
            stub.ReportPlacements(registry_pb2.ReportPlacementsRequest(worker_id="w1"), timeout=10)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize("role", ["registry", "worker"])
def test_only_the_gateways_certificate_calls_a_worker(system: RunningSystem, role: str) -> None:
    generate = worker_pb2.WorkerGenerateRequest(request_id=f"posing-{role}", base_model="tessera-demo-llama",
                                                text="hello", sampling=common_pb2.SamplingParams(max_tokens=2))
    with role_channel(system, system.worker_grpc, role) as channel:
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        for call in (lambda: next(stub.Generate(generate, timeout=10)),
                     lambda: next(stub.WatchState(worker_pb2.WatchStateRequest(interval_ms=50), timeout=10)),
                     lambda: stub.GetStats(worker_pb2.GetStatsRequest(), timeout=10)):
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert f"tessera-{role}" in err.value.details() and "tessera-gateway" in err.value.details()
    # The health service answers every cluster certificate.
    credentials = load_role_credentials(system.config, role).channel()
    assert check_health(system.worker_grpc, timeout_s=10, credentials=credentials)


def test_clients_reach_the_gateways_public_port_without_a_certificate(system: RunningSystem) -> None:
    with grpc.insecure_channel(system.gateway_grpc) as channel:
        models = inference_pb2_grpc.InferenceStub(channel).ListModels(inference_pb2.ListModelsRequest(), timeout=10)
    assert "tessera-demo-llama" in [m.id for m in models.models]


@pytest.mark.parametrize("role", ["registry", "worker", "gateway"])
def test_tessera_health_answers_for_each_role(system: RunningSystem, role: str) -> None:
    address = {"registry": system.registry_grpc, "worker": system.worker_grpc, "gateway": system.gateway_grpc}[role]
    proc = subprocess.run([sys.executable, "-m", "services.cli", "health", "--role", role, address],
                          env=system.env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"{address}: SERVING" in proc.stdout


def test_up_created_the_certificates_private_to_the_owner(system: RunningSystem) -> None:
    directory = tls_paths(system.config).dir
    assert directory == Path(system.home) / "tls"
    assert directory.stat().st_mode & 0o777 == 0o700
    assert {p.stat().st_mode & 0o777 for p in directory.iterdir()} == {0o600}
