"""The registry's placement planner (registry/placement_planner.py): from the requests each adapter brought
the workers (their heartbeats' counts) it plans hot adapters' GPU replicas and warm adapters' host copies
within the workers' budgets, stores the plan, answers it to each worker's heartbeat as preloads (an
operator's order on the same adapter first), shows it in the admin API, and re-plans as popularity drifts."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest

from registry.app import create_admin_app
from registry.placement_planner import PlacementPlanner
from registry.proto_records import stats_to_dict
from registry.store import RegistryStore
from policy.placement import PlanLimits
from tessera.v1 import common_pb2

from .conftest import BASE_MODEL

ADAPTERS = [f"a{i}" for i in range(6)]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _heartbeat(store: RegistryStore, worker_id: str, size: int, counts: dict[str, int], busy_s: float = 0.0) -> None:
    """A worker's heartbeat as the gRPC service stores it: budgets for 2 adapters on the GPU, 4 in host;
    `busy_s`: its seconds stepping since its start."""
    stats = common_pb2.WorkerStats(adapter_gpu_bytes=2 * size, adapter_host_bytes=4 * size, busy_seconds_total=busy_s,
                                   adapter_requests_total=[common_pb2.AdapterRequests(adapter=a, requests=n)
                                                           for a, n in counts.items()])
    assert store.heartbeat(worker_id, stats_to_dict(stats))


def _cluster(store: RegistryStore, imports: Path, device: str) -> tuple[list[str], int]:
    """Six adapters of one size and two workers on `device`: (their ids, an adapter's bytes)."""
    for name in ADAPTERS:  # the same files under each name: one size
        shutil.copytree(imports / "attn-qv", imports / name)
        store.register_adapter(name, BASE_MODEL, str(imports / name))
    workers = [store.register_worker(f"127.0.0.1:{7001 + i}", device, BASE_MODEL, capacity=8).worker_id
               for i in range(2)]
    return workers, store.get_adapter("a0").size_bytes


@pytest.fixture
def cluster(store: RegistryStore, imports: Path):
    return _cluster(store, imports, "cuda:0")


def _first_pass(store: RegistryStore, cluster) -> tuple[Clock, PlacementPlanner, dict[str, int]]:
    """A planner's first pass over workers that have served nothing yet: (its clock, it, the counts)."""
    (w1, w2), size = cluster
    clock = Clock()
    planner = PlacementPlanner(store, PlanLimits(gpu_share=1.0, host_share=0.5, replica_factor=1.0),
                               half_life_s=60.0, clock=clock)
    counts = {name: 0 for name in ADAPTERS}
    for worker in (w1, w2):
        _heartbeat(store, worker, size, counts)
    first = planner.plan(BASE_MODEL)  # the counts so far are history the planner cannot date: no plan
    assert (first.gpu_adapters, first.host_adapters) == (0, 0) and store.list_planned_placements() == []
    return clock, planner, counts


def test_hot_adapters_get_gpu_replicas_warm_ones_host_copies_and_the_workers_are_told(store: RegistryStore,
                                                                                         cluster) -> None:
    (w1, w2), size = cluster
    clock, planner, counts = _first_pass(store, cluster)

    clock.now = 30.0
    _heartbeat(store, w1, size, {**counts, "a0": 300, "a1": 40, "a2": 20, "a3": 10, "a4": 5})
    _heartbeat(store, w2, size, {**counts, "a0": 300, "a1": 40, "a2": 20, "a3": 10, "a4": 5})
    summary = planner.plan(BASE_MODEL)
    planned = {(r.adapter, r.worker_address, r.tier) for r in store.list_planned_placements()}
    # 4 GPU places in all (2 a worker): the 4 most requested once each (no room for a0's replica), then host.
    gpu = {(a, w) for a, w, tier in planned if tier == "gpu"}
    assert {a for a, _ in gpu} == {"a0", "a1", "a2", "a3"} and len(gpu) == 4
    host = {a for a, _, tier in planned if tier == "host"}
    assert host == {"a4"}  # a5 brought no request: cold, on disk
    assert (summary.gpu_adapters, summary.gpu_replicas, summary.host_adapters, summary.moves) == (4, 4, 1, 5)

    orders = {w: store.worker_orders(w, []) for w in (w1, w2)}
    address = {w1: "127.0.0.1:7001", w2: "127.0.0.1:7002"}
    for worker, answer in orders.items():
        assert {a.name for a, pin in answer.placements} == {a for a, w in gpu if w == address[worker]}
        assert not any(pin for _, pin in answer.placements)  # preloads, never pins
        warm_here = {a for a, w, tier in planned if tier == "host" and w == address[worker]}
        assert {a.name for a in answer.host_placements} == warm_here
        # Each order carries the requests/s expected of it there: 600 of a0 in one pass, its rate under a
        # 60 s half-life 600 · ln 2 / 60, all on its one replica.
        if "a0" in answer.planned_rates:
            assert answer.planned_rates["a0"] == pytest.approx(600 * math.log(2) / 60)

    store.place_adapter("a3", [w1], pin=True)  # an operator's order on a planned adapter comes first
    answer = store.worker_orders(w1, [])
    assert ("a3", True) in {(a.name, pin) for a, pin in answer.placements}
    assert "a3" not in {a.name for a in answer.host_placements}

    listed = create_admin_app(store, "k").test_client().get(
        "/admin/v1/placement-plan", headers={"Authorization": "Bearer k"}).get_json()["adapters"]
    assert [e["adapter"] for e in listed][:1] == ["a0"] and listed[0]["tier"] == "gpu"
    assert listed[0]["rate"] == pytest.approx(600 * math.log(2) / 60)
    assert listed[0]["workers"] == [next(w for a, w in gpu if a == "a0")]


def test_a_drift_in_popularity_moves_only_what_moved(store: RegistryStore, cluster) -> None:
    (w1, w2), size = cluster
    clock, planner, totals = _first_pass(store, cluster)

    def traffic(per_adapter: dict[str, int]) -> None:
        for name, n in per_adapter.items():
            totals[name] += n
        clock.now += 30.0
        for worker in (w1, w2):
            _heartbeat(store, worker, size, totals)
    traffic({"a0": 100, "a1": 50, "a2": 30, "a3": 20})
    planner.plan(BASE_MODEL)
    before = {r.adapter: r.tier for r in store.list_planned_placements()}
    assert before["a0"] == "gpu" and "a5" not in before
    for _ in range(6):  # a5 becomes the most requested; a0 falls silent (3 minutes: 3 half-lives)
        traffic({"a5": 200, "a1": 50, "a2": 30, "a3": 20})
        summary = planner.plan(BASE_MODEL)
    after = {r.adapter: r.tier for r in store.list_planned_placements()}
    assert after["a5"] == "gpu" and after.get("a0") != "gpu"
    assert summary.moves == 0  # settled: a plan without a change loads nothing
    store.delete_adapter("a5")  # a deleted adapter leaves the plan with it
    assert "a5" not in {r.adapter for r in store.list_planned_placements()}


def test_turning_placement_off_forgets_the_plan(store: RegistryStore, cluster, tmp_path: Path) -> None:
    from registry.server import _planner
    from services.common.config import load_config

    (w1, w2), size = cluster
    store.replace_planned_placements(BASE_MODEL, {"a0": ["127.0.0.1:7001"]}, {"a1": ["127.0.0.1:7002"]}, {"a0": 1.0})
    assert len(store.list_planned_placements()) == 2
    off = load_config(environ={"TESSERA_HOME": str(tmp_path), "TESSERA_REGISTRY__PLACEMENT_INTERVAL_S": "0"})
    assert _planner(off, store) is None
    assert store.list_planned_placements() == []
    answer = store.worker_orders(w1, [])
    assert answer.placements == () and answer.host_placements == ()


def test_counts_first_seen_after_the_first_pass_are_new_requests(store: RegistryStore, cluster) -> None:
    """Only the first pass's counts are undated history: an adapter a known worker first reports later,
    and a worker that registers later, bring requests made since the last pass."""
    (w1, _), size = cluster
    clock, planner, _ = _first_pass(store, cluster)
    late = store.register_worker("127.0.0.1:7003", "cuda:0", BASE_MODEL, capacity=8).worker_id
    clock.now = 30.0
    _heartbeat(store, w1, size, {"a4": 30})    # a known worker's first request for a4
    _heartbeat(store, late, size, {"a5": 60})  # a worker new since the first pass
    planner.plan(BASE_MODEL)
    rates: dict[str, float] = {}
    for r in store.list_planned_placements():  # each GPU replica's share, summed
        rates[r.adapter] = rates.get(r.adapter, 0.0) + r.rate
    assert rates == pytest.approx({"a4": 30 * math.log(2) / 60, "a5": 60 * math.log(2) / 60})


@pytest.mark.parametrize("busy_s, replicas", [(30.0, 2), (0.3, 1)], ids=["busy", "idle"])
def test_a_hot_adapter_is_replicated_only_as_far_as_the_workers_are_busy(store: RegistryStore, cluster,
                                                                          busy_s: float, replicas: int) -> None:
    """Replicas spread a hot adapter's work: workers busy all of the last 5 minutes get a0 on both (its
    share of two busy workers), workers busy 1% of them keep one copy, and the room stays the workers' own."""
    (w1, w2), size = cluster
    clock, planner, counts = _first_pass(store, cluster)
    for n in range(1, 11):  # a pass every 30 s, each worker `busy_s` of every 30 s stepping
        clock.now = 30.0 * n
        for worker in (w1, w2):
            _heartbeat(store, worker, size, {**counts, "a0": 300, "a1": 10}, busy_s=busy_s * n)
        summary = planner.plan(BASE_MODEL)
    gpu = [r.worker_address for r in store.list_planned_placements() if r.adapter == "a0" and r.tier == "gpu"]
    assert len(gpu) == replicas and summary.gpu_adapters == 2


def test_cpu_workers_get_no_host_copies(store: RegistryStore, imports: Path) -> None:
    """A CPU worker's "GPU" tier is host memory: a host copy would save its loads nothing."""
    cpu, size = _cluster(store, imports, "cpu")
    clock, planner, counts = _first_pass(store, (cpu, size))
    clock.now = 30.0
    for worker in cpu:
        _heartbeat(store, worker, size, {**counts, "a0": 300, "a1": 40, "a2": 20, "a3": 10, "a4": 5})
    summary = planner.plan(BASE_MODEL)
    assert summary.gpu_adapters == 4 and summary.host_adapters == 0  # a4 stays on disk
