"""Router: the configured policy over the workers' pushed state; ties round-robin, failed workers
skipped a while, SLOs of in-flight requests tracked per worker, clear errors when none fits."""

from __future__ import annotations

import pytest

from gateway.router import POLICIES, Router, build_policy
from policy.perf_model import PERF_MODELS_DIR, load_perf_models
from policy.batch_summary import BatchEntry
from policy.routing.policies import MostIdle, RoutingRequest, Slo
from policy.routing.worker_state import WorkerState, WorkerStateTable
from services.common.config import ConfigError
from services.common.errors import Unavailable
from tessera.v1 import common_pb2

WORKERS = [common_pb2.WorkerInfo(address=a, base_model="b", healthy=True) for a in ("w:3", "w:1", "w:2")]
REQUEST = RoutingRequest("a", 8, 16, 16, Slo(tpot_s=0.2, ttft_s=5.0))
KIND = "cpu-tessera-demo-llama"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def report(table: WorkerStateTable, address: str, at: float, running: int = 0, gpu: frozenset = frozenset()) -> None:
    table.report(WorkerState(address, "b", KIND, tuple(BatchEntry("x", 8, 100) for _ in range(running)), (), gpu, gpu,
                             4, 8, 10_000, None, at))


def router(policy=None, clock: Clock | None = None, mark_down_s: float = 2.0) -> tuple[Router, Clock]:
    clock = clock or Clock()
    table = WorkerStateTable(clock, stale_after_s=1.0)
    for w in WORKERS:
        report(table, w.address, clock.now)
    return Router(policy or MostIdle(), table, mark_down_s, clock), clock


def test_ties_round_robin_in_address_order() -> None:
    r, clock = router()
    for w in WORKERS:  # each pick is pending until a newer report: re-report to keep every worker idle
        report(r.table, w.address, clock.now)
    picks = []
    for _ in range(6):
        picks.append(r.pick(REQUEST, "b", WORKERS).address)
        clock.now += 0.01
        for w in WORKERS:
            report(r.table, w.address, clock.now)
    assert picks == ["w:1", "w:2", "w:3"] * 2


def test_least_loaded_by_reported_state_and_own_dispatches() -> None:
    r, clock = router()
    report(r.table, "w:1", clock.now, running=2)
    report(r.table, "w:2", clock.now, running=1)
    assert r.pick(REQUEST, "b", WORKERS).address == "w:3"
    assert r.pick(REQUEST, "b", WORKERS).address in ("w:2", "w:3")  # w:3 now has our dispatch pending


def test_marked_down_worker_is_skipped_until_the_time_passes() -> None:
    r, clock = router(mark_down_s=0.05)
    r.mark_down("w:1")
    r.mark_down("w:2")
    assert {r.pick(REQUEST, "b", WORKERS).address for _ in range(4)} == {"w:3"}
    clock.now += 0.06
    for w in WORKERS:
        report(r.table, w.address, clock.now)
    assert r.pick(REQUEST, "b", WORKERS).address in ("w:1", "w:2")


def test_a_worker_without_fresh_state_is_out_of_rotation() -> None:
    r, clock = router()
    clock.now += 0.9
    report(r.table, "w:2", clock.now)
    clock.now += 0.2  # w:1 and w:3 last reported 1.1 s ago
    assert {r.pick(REQUEST, "b", WORKERS).address for _ in range(3)} == {"w:2"}
    clock.now += 2.0
    with pytest.raises(Unavailable, match=r"no healthy worker serves base model 'b' \(3 registered, none reporting"):
        r.pick(REQUEST, "b", WORKERS)


def test_no_worker_is_unavailable() -> None:
    r, _ = router()
    with pytest.raises(Unavailable, match=r"no live worker serves base model 'b': start one \(`tessera up`.*"
                                          r"TESSERA_WORKER__BASE_MODEL=b\)"):
        r.pick(REQUEST, "b", [])
    r.mark_down("w:1")
    with pytest.raises(Unavailable, match="1 recently failed"):
        r.pick(REQUEST, "b", WORKERS[1:2])


def test_tightest_slo_of_requests_in_flight() -> None:
    r, _ = router()
    assert r.tightest_tpot_slo_s("w:1") is None
    r.started("w:1", "r1", 0.2)
    r.started("w:1", "r2", 0.05)
    assert r.tightest_tpot_slo_s("w:1") == 0.05 and r.in_flight("w:1") == 2
    r.finished("w:1", "r2")
    assert r.tightest_tpot_slo_s("w:1") == 0.2
    r.finished("w:1", "r1")
    assert r.tightest_tpot_slo_s("w:1") is None and r.in_flight("w:1") == 0


def test_tessera_prefers_the_worker_holding_the_adapter() -> None:
    policy = build_policy("tessera", load_perf_models(PERF_MODELS_DIR))
    r, clock = router(policy)
    report(r.table, "w:2", clock.now, gpu=frozenset({"a"}))
    assert r.pick(REQUEST, "b", WORKERS).address == "w:2"


def test_every_policy_builds_and_unknown_ones_are_config_errors() -> None:
    models = load_perf_models(PERF_MODELS_DIR)
    assert KIND in models and models[KIND].decode.r2 is not None
    for name in POLICIES:
        assert build_policy(name, models).name == name
    with pytest.raises(ConfigError, match="unknown policy 'fastest'; known: tessera, most-idle"):
        build_policy("fastest", models)
    assert build_policy("tessera", {}).name == "tessera"  # workers bring their models (gateway/state_feed.py)
