"""The planner's lease (registry/planner_lease.py): of the registry replicas sharing a database one plans
placements at a time, the lease passes on when its holder gives it back or loses its connection, and a
replica without it skips its planning passes (registry/server.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from registry.placement_planner import PlacementPlanner
from registry.planner_lease import PlannerLease
from registry.server import _plan_placements
from registry.store import RegistryStore
from policy.placement import PlanLimits

from .conftest import FakeClock


def test_one_replica_holds_the_lease_until_it_gives_it_back(database_url: str) -> None:
    first, second = PlannerLease(database_url), PlannerLease(database_url)
    try:
        assert first.held() and not second.held()
        assert first.held() and not second.held()  # asked again: still the first's
        first.close()
        assert second.held()
        again = PlannerLease(database_url)
        assert not again.held()
        again.close()
    finally:
        first.close()
        second.close()


def test_an_in_memory_database_has_one_process_and_it_plans() -> None:
    lease = PlannerLease("sqlite://")
    assert lease.held()
    lease.close()


@pytest.mark.postgres
def test_the_lease_goes_with_its_holders_broken_connection(postgres_server) -> None:
    url = postgres_server.new_database()
    first, second = PlannerLease(url), PlannerLease(url)
    try:
        assert first.held() and not second.held()
        postgres_server.terminate_connections()  # the first replica's session, and its lock, are gone
        assert second.held()
        assert not first.held()  # it notices the loss and finds the lease taken
    finally:
        first.close()
        second.close()


def test_only_the_lease_holder_runs_planning_passes(database_url: str, tmp_path: Path, imports: Path) -> None:
    stores = [RegistryStore(database_url, tmp_path / "store", [imports], worker_timeout_s=10.0, clock=FakeClock())
              for _ in range(2)]
    passes = [0, 0]
    while_both_ran: list[int] = []
    planners = [PlacementPlanner(store, PlanLimits(), half_life_s=60.0) for store in stores]
    for i, planner in enumerate(planners):
        plan_all = planner.plan_all

        def counted(i: int = i, plan_all=plan_all):  # type: ignore[no-untyped-def]
            passes[i] += 1
            return plan_all()
        planner.plan_all = counted  # type: ignore[method-assign]

    async def run() -> None:
        stop = asyncio.Event()
        leases = [PlannerLease(database_url) for _ in planners]
        assert leases[0].held()  # the first replica leads from the start
        tasks = [asyncio.create_task(_plan_placements(p, lease, 0.02, stop)) for p, lease in zip(planners, leases)]
        await asyncio.sleep(0.5)
        while_both_ran.extend(passes)  # (at the stop the second may take the lease the first gives back)
        stop.set()
        await asyncio.gather(*tasks)
        assert PlannerLease(database_url).held()  # both gave theirs back at the end
    try:
        asyncio.run(run())
    finally:
        for store in stores:
            store.close()
    assert while_both_ran[0] >= 2 and while_both_ran[1] == 0
