"""The registry's placement planner: ROCK's popularity-driven placement, planned every interval and carried
out by the workers as preloads.

Each pass, per base model: the requests each adapter brought every healthy worker since the last pass
(their heartbeats carry counts since each worker's start) feed a decayed `Popularity`; the plan
(policy/placement.py) puts hot adapters' replicas on workers' GPUs (as many as their
share of the workers' busy time calls for, decayed with the same half-life), warm adapters in
host memory and leaves cold ones on disk, within a planned share of each worker's tiers (the budgets its
heartbeats report), keeping adapters where they are held; it is stored (RegistryStore.
replace_planned_placements) and goes to each worker with its heartbeat answers. An operator's order on the
same adapter and worker takes precedence. Of the registry replicas sharing a database, the one holding the
planner's lease plans (registry/planner_lease.py); the others skip their passes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from registry.records import PlacementInputs
from registry.store import RegistryStore
from policy.placement import (BusyTime, PlacementPlan, PlanLimits, Popularity, WorkerRoom,
                              plan_placement)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PlanSummary:
    base_model: str
    gpu_adapters: int   # hot
    gpu_replicas: int
    host_adapters: int  # warm
    moves: int          # replicas this plan added over the last


class PlacementPlanner:
    def __init__(self, store: RegistryStore, limits: PlanLimits, half_life_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._store, self._limits, self._half_life_s, self._clock = store, limits, half_life_s, clock
        self._popularity: dict[str, Popularity] = {}
        self._busy: dict[str, BusyTime] = {}  # by base model: its workers' busy time between passes
        self._seen: dict[tuple[str, str], int] = {}  # (worker id, adapter) -> its request count at the last pass
        self._plans: dict[str, PlacementPlan] = {}

    def plan_all(self) -> list[PlanSummary]:
        """One pass over every base model (blocking: the database and the plan)."""
        return [self.plan(model.name) for model in self._store.list_base_models()]

    def plan(self, base_model: str) -> PlanSummary:
        now = self._clock()
        inputs = self._store.placement_inputs(base_model)
        first_pass = base_model not in self._popularity
        popularity = self._popularity.setdefault(base_model, Popularity(self._half_life_s))
        self._count_requests(inputs, popularity, now, first_pass)
        rates = popularity.rates(now)
        busy_workers = self._busy.setdefault(base_model, BusyTime(self._half_life_s)).busy_workers(
            {w.worker_id: float(w.stats.get("busy_seconds_total", 0.0)) for w in inputs.workers}, now)
        # A CPU worker's "GPU" tier is host memory too: a host copy would save it nothing, so none is planned.
        rooms = [WorkerRoom(w.address, int(w.stats.get("adapter_gpu_bytes", 0)),
                            0 if w.device.partition(":")[0] == "cpu" else int(w.stats.get("adapter_host_bytes", 0)))
                 for w in inputs.workers]
        plan = plan_placement(rates, inputs.sizes, rooms, inputs.on_gpu, self._limits, inputs.in_host, busy_workers)
        moves = plan.moves(self._plans.get(base_model, PlacementPlan()))
        self._plans[base_model] = plan
        self._store.replace_planned_placements(base_model, plan.gpu, plan.host, rates)
        summary = PlanSummary(base_model, len(plan.gpu), sum(map(len, plan.gpu.values())), len(plan.host), moves)
        if moves:
            log.info("placement of %s: %d hot adapters (%d GPU replicas), %d warm, %d new replicas", base_model,
                     summary.gpu_adapters, summary.gpu_replicas, summary.host_adapters, moves)
        return summary

    def _count_requests(self, inputs: PlacementInputs, popularity: Popularity, now: float, first_pass: bool) -> None:
        """The requests since the last pass. The counts of the planner's first pass are history from before
        it looked (undated: left out); from then on a count not seen before is all new (a worker that
        registered since, or an adapter first requested since), and one that went down is a restarted
        worker's (all new)."""
        for worker in inputs.workers:
            for entry in worker.stats.get("adapter_requests_total", []):
                key, total = (worker.worker_id, entry["adapter"]), int(entry["requests"])
                before = self._seen.get(key)
                self._seen[key] = total
                if first_pass or total == before:
                    continue
                new = total - before if before is not None and total > before else total
                popularity.record(entry["adapter"], now, new)
