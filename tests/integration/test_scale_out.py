"""Scale-out on real processes: two registry replicas on one PostgreSQL database, and two gateways (one
following each replica) sharing one worker that registered with the first replica. Both gateways route to
it (each gets its state feed), admission is each gateway's own, and an adapter deleted through the first
replica leaves the second replica's gateway at once, long before its periodic refresh."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import requests

from benchmarks.harness.live_system import RunningSystem, log_tail, spawn_role, stop_role
from benchmarks.harness.ports import free_port_plan
from services.demo_assets import DEMO_BASE_MODEL

pytestmark = [pytest.mark.integration, pytest.mark.postgres]

ADAPTER = "demo-r8"
QUEUE_BOUND = 1  # requests in flight per base model at each gateway


@dataclass
class ScaledOut:
    admin: list[str]    # each replica's admin API (…/admin/v1)
    gateways: list[str]  # each gateway's REST base (…/v1)
    admin_key: str

    def admin_call(self, replica: int, method: str, path: str, body: dict | None = None) -> requests.Response:
        return requests.request(method, f"{self.admin[replica]}{path}", json=body, timeout=60,
                                headers={"Authorization": f"Bearer {self.admin_key}"})

    def complete(self, gateway: int, model: str, max_tokens: int = 4, stream: bool = False) -> requests.Response:
        return requests.post(f"{self.gateways[gateway]}/completions", stream=stream, timeout=120, json={
            "model": model, "prompt": "def add(a, b):", "max_tokens": max_tokens, "temperature": 0, "stream": stream})


def _wait(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def scaled_out(system: RunningSystem, postgres_server, tmp_path_factory) -> Iterator[ScaledOut]:
    store = tmp_path_factory.mktemp("replicas-store")
    shared = {**system.env, "TESSERA_REGISTRY__DATABASE_URL": postgres_server.new_database(migrated=False),
              "TESSERA_REGISTRY__ADAPTER_STORE": str(store), "TESSERA_GATEWAY__METADATA_REFRESH_S": "30",
              "TESSERA_GATEWAY__MAX_QUEUED_PER_MODEL": str(QUEUE_BOUND)}
    free = iter(free_port_plan([str(n) for n in range(14)], [], 0).values())  # 14 distinct ports
    registries = [{f"TESSERA_REGISTRY__{k}": str(next(free)) for k in ("GRPC_PORT", "ADMIN_PORT", "METRICS_PORT")}
                  for _ in range(2)]
    gateways = [{f"TESSERA_GATEWAY__{k}": str(next(free)) for k in ("HTTP_PORT", "GRPC_PORT", "METRICS_PORT")}
                for _ in range(2)]
    worker = {f"TESSERA_WORKER__{k}": str(next(free)) for k in ("GRPC_PORT", "METRICS_PORT")}
    processes = []
    log_path = system.home / "scale-out-test.log"
    log = open(log_path, "w")
    try:
        try:
            for ports in registries:  # both at once: they migrate the empty database together
                processes.append(spawn_role("registry", {**shared, **ports}, log))
            for ports, process in zip(registries, processes):
                system.wait_healthy(f"127.0.0.1:{ports['TESSERA_REGISTRY__GRPC_PORT']}", "registry", timeout_s=120,
                                    process=process)
            first, second = (f"127.0.0.1:{ports['TESSERA_REGISTRY__GRPC_PORT']}" for ports in registries)
            cluster = ScaledOut([f"http://127.0.0.1:{p['TESSERA_REGISTRY__ADMIN_PORT']}/admin/v1" for p in registries],
                                [f"http://127.0.0.1:{p['TESSERA_GATEWAY__HTTP_PORT']}/v1" for p in gateways],
                                system.admin_key)
            models = system.home / "models"
            assert cluster.admin_call(0, "POST", "/base-models", {
                "name": DEMO_BASE_MODEL, "path": str(models / DEMO_BASE_MODEL)}).status_code == 201
            assert cluster.admin_call(1, "POST", "/adapters", {   # through the other replica: one catalog
                "name": ADAPTER, "base_model": DEMO_BASE_MODEL, "path": str(models / "adapters" / ADAPTER)}).status_code == 201
            processes.append(spawn_role("worker", {**shared, **worker, "TESSERA_WORKER__REGISTRY_ADDRESS": first}, log))
            system.wait_healthy(f"127.0.0.1:{worker['TESSERA_WORKER__GRPC_PORT']}", "worker", timeout_s=180,
                                process=processes[-1])
            for ports, registry in zip(gateways, (first, second)):
                processes.append(spawn_role("gateway", {**shared, **ports, "TESSERA_GATEWAY__REGISTRY_ADDRESS": registry}, log))
                system.wait_healthy(f"127.0.0.1:{ports['TESSERA_GATEWAY__GRPC_PORT']}", "gateway", timeout_s=60,
                                    process=processes[-1])
            for gateway in range(2):
                _wait(lambda: cluster.complete(gateway, DEMO_BASE_MODEL, 1).status_code == 200, 60,
                      f"gateway {gateway} routing")
        except Exception as exc:  # the roles' log says why, not the timeout
            log.flush()
            raise RuntimeError(f"the scaled-out cluster did not start; its log ends:\n{log_tail(log_path)}") from exc
        yield cluster
    finally:
        for process in reversed(processes):
            stop_role(process)
        log.close()


def test_both_replicas_see_the_worker_and_both_gateways_route_to_it(scaled_out: ScaledOut) -> None:
    listed = [{w["address"] for w in scaled_out.admin_call(r, "GET", "/workers").json()["workers"]} for r in range(2)]
    assert listed[0] == listed[1] and len(listed[0]) == 1  # registered with the first, known to both
    outputs = [scaled_out.complete(g, ADAPTER, 6).json()["choices"][0]["text"] for g in range(2)]
    assert outputs[0] == outputs[1]  # one worker, one adapter, greedy


def test_admission_is_each_gateways_own(scaled_out: ScaledOut) -> None:
    held = scaled_out.complete(0, ADAPTER, max_tokens=200, stream=True)  # in flight at gateway 0
    try:
        lines = held.iter_lines()
        assert next(line for line in lines if line).startswith(b"data: ")
        assert scaled_out.complete(0, ADAPTER).status_code == 429  # gateway 0's bound is taken ...
        assert scaled_out.complete(1, ADAPTER).status_code == 200  # ... gateway 1's is not
    finally:
        held.close()


def test_a_delete_through_one_replica_reaches_the_other_replicas_gateway_at_once(scaled_out: ScaledOut) -> None:
    assert scaled_out.complete(1, ADAPTER).status_code == 200
    deleted_at = time.monotonic()
    assert scaled_out.admin_call(0, "DELETE", f"/adapters/{ADAPTER}").status_code == 200
    _wait(lambda: scaled_out.complete(1, ADAPTER).status_code == 404, 10, "gateway 1 to refuse the deleted adapter")
    assert time.monotonic() - deleted_at < 5  # its periodic refresh is every 30 s: the replicas' feed told it
    error = scaled_out.complete(1, ADAPTER).json()["error"]
    assert ADAPTER in json.dumps(error)
