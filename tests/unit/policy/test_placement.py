"""ROCK's placement plan (policy/placement.py): popularity with a half-life, hot
adapters replicated on GPUs by their traffic share, warm ones in host memory, cold ones on disk, within
the planned share of each tier, and plans that keep adapters where they are held."""

from __future__ import annotations

import pytest

from policy.placement import (BusyTime, PlacementPlan, PlanLimits, Popularity, WorkerRoom,
                              plan_placement, replicas_for)

MB = 1 << 20


def rooms(n: int, gpu_mb: int = 100, host_mb: int = 400) -> list[WorkerRoom]:
    return [WorkerRoom(f"w{i}", gpu_mb * MB, host_mb * MB) for i in range(n)]


def test_popularity_reads_a_steady_rate_and_forgets_with_its_half_life() -> None:
    popularity = Popularity(half_life_s=10.0)
    for i in range(2000):  # 2 requests/s for 1000 s: the decayed rate settles at 2
        popularity.record("a", i * 0.5)
    assert popularity.rates(1000.0)["a"] == pytest.approx(2.0, rel=0.05)
    assert popularity.rates(1010.0)["a"] == pytest.approx(1.0, rel=0.05)  # a half-life later: half


def test_replicas_follow_the_traffic_share_of_the_busy_workers() -> None:
    assert replicas_for(30.0, 100.0, workers=10, busy_workers=10.0) == 3
    assert replicas_for(30.0, 100.0, workers=10, busy_workers=2.0) == 1  # an idle cluster: one copy is enough
    assert replicas_for(30.0, 100.0, workers=10, busy_workers=2.0, factor=10.0) == 6
    assert replicas_for(0.1, 100.0, workers=10, busy_workers=10.0) == 1  # one at least
    assert replicas_for(100.0, 100.0, workers=10, busy_workers=10.0, factor=3.0) == 10  # never more than the workers


def test_busy_time_reads_each_workers_steady_busy_fraction_and_sums_them() -> None:
    busy = BusyTime(half_life_s=10.0)
    assert busy.busy_workers({"a": 100.0, "b": 5.0}, now=1000.0) == 0.0  # first readings: nothing to compare
    for i in range(1, 301):  # a: busy half of each second; b: overlapping async steps, 2 s a second
        busy.busy_workers({"a": 100.0 + 0.5 * i, "b": 5.0 + 2.0 * i}, now=1000.0 + i)
    assert busy.busy_workers({"a": 250.5, "b": 607.0}, now=1301.0) == pytest.approx(1.5, rel=0.05)  # b: 1 at most


def test_busy_time_does_not_read_one_burst_as_a_busy_cluster_and_restarts_count_from_the_next_reading() -> None:
    busy = BusyTime(half_life_s=60.0)
    busy.busy_workers({"a": 0.0}, now=0.0)
    assert busy.busy_workers({"a": 3.0}, now=3.0) < 0.05  # 3 s busy out of 3: one burst, not a busy worker
    assert busy.busy_workers({"a": 1.0, "b": 50.0}, now=6.0) == pytest.approx(busy.busy_workers({"a": 1.0}, now=6.0))
    # a restarted (its counter went down) and b is new: neither adds time until its next reading.
    assert busy.busy_workers({"a": 2.0, "b": 50.0}, now=7.0) > busy.busy_workers({"a": 2.0, "b": 50.0}, now=7.5)


def test_an_idle_cluster_leaves_its_room_to_the_workers_own_loads_where_a_busy_one_replicates() -> None:
    rates = {"hot": 50.0, **{f"a{i}": 1.0 for i in range(29)}}
    sizes = {name: 10 * MB for name in rates}
    limits = PlanLimits(gpu_share=1.0, replica_factor=1.0)
    busy = plan_placement(rates, sizes, rooms(4, gpu_mb=200), limits=limits, busy_workers=4.0)
    idle = plan_placement(rates, sizes, rooms(4, gpu_mb=200), limits=limits, busy_workers=0.2)
    # Every adapter once (30 of the 80 places); then hot's share of the work: ceil(4 x 50/79) = 3 replicas
    # busy, ceil(0.2 x 50/79) = 1 idle.
    assert len(busy.gpu["hot"]) == 3 and len(idle.gpu["hot"]) == 1
    assert set(busy.gpu) == set(idle.gpu) == set(rates)


def test_with_room_to_spare_hot_adapters_are_replicated_by_their_traffic_share() -> None:
    rates = {"hot": 50.0, "busy": 20.0, **{f"a{i}": 1.0 for i in range(10)}}
    sizes = {name: 10 * MB for name in rates}
    plan = plan_placement(rates, sizes, rooms(4, gpu_mb=200), limits=PlanLimits(gpu_share=0.5, replica_factor=1.0))
    # 4 workers x 100 MB planned = 40 places of 10 MB: every adapter once, then hot's further replicas.
    assert len(plan.gpu["hot"]) == 3 and len(plan.gpu["busy"]) == 1  # ceil(4 x 50/80), ceil(4 x 20/80)
    assert all(len(plan.gpu[f"a{i}"]) == 1 for i in range(10)) and plan.host == {}
    roomy = plan_placement(rates, sizes, rooms(4, gpu_mb=200), limits=PlanLimits(0.5, replica_factor=8.0))
    assert roomy.gpu["busy"] == ("w0", "w1", "w2", "w3")  # a larger factor: more holders to spare


def test_tight_tiers_hold_as_many_adapters_as_they_can_before_any_replica_then_host_then_disk() -> None:
    rates = {"hot": 50.0, "cold": 0.0, **{f"a{i}": 1.0 for i in range(30)}}
    sizes = {name: 10 * MB for name in rates}
    limits = PlanLimits(gpu_share=0.5, host_share=0.25, replica_factor=8.0)
    plan = plan_placement(rates, sizes, rooms(4), limits=limits)
    # 20 GPU places: hot and the 19 next adapters once each, no replica; 4 x 100 MB of host: the other 11.
    assert len(plan.gpu) == 20 and all(len(ws) == 1 for ws in plan.gpu.values()) and "hot" in plan.gpu
    assert len(plan.host) == 11 and all(len(ws) == 1 for ws in plan.host.values())
    assert plan.tier_of("cold") == "disk"  # never requested
    for worker in ("w0", "w1", "w2", "w3"):  # the planned share of each tier, never more
        gpu, host = plan.on_worker(worker)
        assert sum(sizes[a] for a in gpu) <= 50 * MB and sum(sizes[a] for a in host) <= 100 * MB


def test_a_tier_without_room_sends_the_rest_to_the_next_and_cold_adapters_stay_on_disk() -> None:
    rates = {f"a{i}": 10.0 - i for i in range(10)}
    sizes = {name: 30 * MB for name in rates}
    limits = PlanLimits(0.6, 0.6, replica_factor=1.0)
    plan = plan_placement(rates, sizes, rooms(2, gpu_mb=100, host_mb=100), limits=limits)
    # 60 MB planned per GPU tier: two 30 MB adapters each; then 60 MB of host: two each; the rest cold.
    assert sum(map(len, plan.gpu.values())) == 4 and len(plan.host) == 4
    assert [plan.tier_of(f"a{i}") for i in range(10)].count("disk") >= 2
    assert plan.tier_of("a0") == "gpu" and plan.tier_of("a9") == "disk"  # the most requested first


def test_a_new_plan_keeps_adapters_where_they_are_held_and_moves_only_what_popularity_moved() -> None:
    rates = {f"a{i}": 1.0 for i in range(8)}
    sizes = {name: 10 * MB for name in rates}
    workers = rooms(4, gpu_mb=40, host_mb=1)
    limits = PlanLimits(gpu_share=0.5, replica_factor=1.0)
    first = plan_placement(rates, sizes, workers, limits=limits)
    held = {a: ws for a, ws in first.gpu.items()}
    again = plan_placement(rates, sizes, workers, held, limits)
    assert again == first and again.moves(first) == 0
    drifted = {**rates, "a0": 0.0, "new": 1.0}
    moved = plan_placement(drifted, {**sizes, "new": 10 * MB}, workers, held, limits)
    assert "a0" not in moved.gpu and "new" in moved.gpu
    assert moved.moves(first) == 1  # only the newcomer is loaded anywhere
    assert moved.moves(PlacementPlan()) == sum(map(len, moved.gpu.values()))


def test_no_workers_or_no_demand_plans_nothing() -> None:
    assert plan_placement({"a": 1.0}, {"a": MB}, []) == PlacementPlan()
    assert plan_placement({}, {"a": MB}, rooms(2)) == PlacementPlan()
