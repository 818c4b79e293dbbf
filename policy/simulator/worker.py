"""One simulated GPU worker: continuous batching over the perf model, adapter tiers with load times.

A step runs the decode of every running request plus the prefill of the requests admitted at its
start (not chunked), and takes decode(batch) + prefill(admitted) by the perf model. Admission is
first come first served among requests whose adapter is ready, within `max_batch`, the KV budget
(prompt + output tokens reserved at admission) and `max_prefill_tokens` per step; a request whose
adapter is still loading is skipped, not blocking those behind it. Adapter memory and loads are the
real worker's own residency (policy/residency.py: byte budgets, eviction, an adapter a request holds is
never evicted) and its placement orders (policy/placement_orders.py), with the two load stages beside
serving timed on the simulated clock (loads.py), so a load delays only the requests that need its adapter.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from policy.adapter_tiers import LoadCosts, Tier
from policy.placement_orders import OrderBook, PlacementOrders, Preload
from policy.simulator.loads import Schedule, SimAdapter, SimLoads
from policy.simulator.workload import SimRequest
from policy.batch_summary import BatchEntry, BatchSummary
from policy.eviction import Eviction
from policy.perf_model import PerfModel
from policy.routing.worker_state import WorkerState

Finished = Callable[[SimRequest, float, float], None]        # (request, first token at, finished at)


@dataclass(frozen=True)
class WorkerConfig:
    max_batch: int = 64
    kv_tokens: int = 200_000          # ~100 GB of KV at 512 KB per token (Llama-2-7B, bf16) on a 141 GB H200
    max_prefill_tokens: int = 8192    # per step; a longer prompt is admitted alone
    gpu_adapter_bytes: int = 32 * LoadCosts().adapter_bytes(64)    # 4 GiB: 32 rank-64 q,k,v,o adapters of a 7B
    host_adapter_bytes: int = 128 * LoadCosts().adapter_bytes(64)  # 16 GiB of pinned host memory
    loader_threads: int = 2           # disk -> host loads at once

    def __post_init__(self) -> None:
        for name in ("max_batch", "kv_tokens", "max_prefill_tokens", "gpu_adapter_bytes", "host_adapter_bytes",
                     "loader_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"worker {name} must be >= 1, got {getattr(self, name)}")
        if self.host_adapter_bytes < self.gpu_adapter_bytes:
            raise ValueError(f"the host tier holds a copy of every GPU adapter: host adapter memory "
                             f"({self.host_adapter_bytes} B) must be >= GPU adapter memory "
                             f"({self.gpu_adapter_bytes} B)")


class _Live:
    __slots__ = ("req", "admitted_step", "first_token_s")

    def __init__(self, req: SimRequest) -> None:
        self.req = req
        self.admitted_step = -1
        self.first_token_s = float("nan")


class SimWorker:
    def __init__(self, address: str, base_model: str, model: PerfModel, load_costs: LoadCosts, eviction: Eviction,
                 config: WorkerConfig, schedule: Schedule, finished: Finished, clock: Callable[[], float]) -> None:
        self.address = address
        self._base_model = base_model
        self._model = model
        self._loads = SimLoads(config.gpu_adapter_bytes, config.host_adapter_bytes, eviction, load_costs,
                               config.loader_threads, schedule, self._load_advanced, clock)
        self._residency = self._loads.residency
        self._tiers = self._residency.tiers
        self._orders = OrderBook(self._residency)
        self._plan = PlacementOrders()
        # The wire still counts GPU adapter slots (nothing routes on it): report rank-64 adapters' worth.
        self._gpu_adapter_slots = config.gpu_adapter_bytes // load_costs.adapter_bytes(64)
        self._config = config
        self._schedule = schedule
        self._finished = finished
        self._queue: list[_Live] = []
        self._running: dict[int, _Live] = {}
        self._prefilling: list[_Live] = []    # admitted at the start of the step in flight
        self._batch = BatchSummary()          # decode entries of `_running`, context tokens
        self._finish_at: list[tuple[int, int]] = []  # heap of (step of the last token, request index)
        self._step = 0                        # steps completed
        self._stepping = False
        self._kv_free = config.kv_tokens
        self._events = 0                      # arrivals, step ends and load ends so far: every change is one
        self._last_report: tuple[int, WorkerState] | None = None
        self.busy_s = 0.0

    def stage(self, adapter: str, rank: int) -> bool:
        """Initial placement: `adapter` into host memory, if it fits in what is free."""
        return self._loads.stage(SimAdapter(adapter, rank))

    def place(self, gpu: Iterable[tuple[str, int, float]], host: Iterable[tuple[str, int, float]], now: float) -> None:
        """A new placement plan's share of this worker (policy/placement.py) as (adapter, rank, requests/s
        expected here): `gpu` loaded onto the GPU, `host` read into host memory only. The orders are carried
        out at each heartbeat's `answer`, as the real worker takes the registry's."""
        self._plan = PlacementOrders(preloads=tuple(Preload(SimAdapter(a, rank), rate) for a, rank, rate in gpu),
                                     host_preloads=tuple(Preload(SimAdapter(a, rank), rate) for a, rank, rate in host))
        self.answer(now)

    def answer(self, now: float) -> None:
        """A heartbeat's answer: the plan's orders, applied as the real worker applies them (each carried out
        once, declined while another load is in flight or waited for, or while it would displace hotter
        adapters; a declined one is offered again at the next answer)."""
        self._orders.apply(self._plan)
        self._residency.advance()

    # ---- requests in ----------------------------------------------------------------------

    def receive(self, req: SimRequest, now: float) -> bool:
        """A request arrives; returns whether its adapter was ready on the GPU (a cache hit)."""
        self._events += 1
        hit = self._residency.arrive(SimAdapter(req.adapter, req.rank))
        self._queue.append(_Live(req))
        self._kick(now)
        return hit

    def _load_advanced(self, now: float) -> None:
        """SimLoads' callback: an adapter finished a stage (a copy's end makes its requests admissible)."""
        self._events += 1
        self._kick(now)

    # ---- steps ------------------------------------------------------------------------------

    def _kick(self, now: float) -> None:
        if not self._stepping:
            self._start_step(now)

    def _start_step(self, now: float) -> None:
        admitted = self._admit() if self._queue else []
        duration = self._model.decode_s(self._batch)
        if admitted:
            duration += self._model.prefill_s(
                BatchSummary.of(BatchEntry(l.req.adapter, l.req.rank, l.req.prompt) for l in admitted))
        if duration == 0.0:
            return  # nothing to run: idle until a request or a load arrives
        self._prefilling = admitted
        self._stepping = True
        self.busy_s += duration
        self._schedule(now + duration, self._end_step)

    def _admit(self) -> list[_Live]:
        """First come, first served among ready requests: the first ready one that does not fit
        stops admission, so a long prompt is not overtaken forever."""
        admitted, waiting, budget = [], [], self._config.max_prefill_tokens
        room = self._config.max_batch - len(self._running)
        blocked = False
        for live in self._queue:
            req = live.req
            if not blocked and self._loads.ready(SimAdapter(req.adapter, req.rank)):
                need = req.prompt + req.output
                if room > 0 and need <= self._kv_free and (req.prompt <= budget or not admitted):
                    admitted.append(live)
                    room -= 1
                    budget -= req.prompt
                    self._kv_free -= need
                    continue
                blocked = True
            waiting.append(live)
        self._queue = waiting
        return admitted

    def _end_step(self, now: float) -> None:
        self._events += 1
        self._stepping = False
        step = self._step
        self._step += 1
        for live in self._prefilling:
            req = live.req
            live.admitted_step = step
            self._running[req.index] = live
            self._batch.add(BatchEntry(req.adapter, req.rank, req.prompt))
            heapq.heappush(self._finish_at, (step + req.output - 1, req.index))
            live.first_token_s = now
        self._prefilling = []
        self._batch.advance()
        while self._finish_at and self._finish_at[0][0] <= step:
            _, index = heapq.heappop(self._finish_at)
            self._finish(self._running.pop(index), now)
        self._start_step(now)

    def _finish(self, live: _Live, now: float) -> None:
        req = live.req
        self._batch.remove(BatchEntry(req.adapter, req.rank, req.prompt + self._step - live.admitted_step))
        self._kv_free += req.prompt + req.output
        self._residency.depart(SimAdapter(req.adapter, req.rank))
        self._residency.advance()
        self._finished(req, live.first_token_s, now)

    # ---- reporting --------------------------------------------------------------------------

    def report(self, now: float) -> WorkerState:
        if self._last_report is not None and self._last_report[0] == self._events:
            # Nothing changed but time: a heartbeat, with the victim's rate decayed to now.
            return dataclasses.replace(self._last_report[1], timestamp=now,
                                       gpu_victim_rate=self._tiers.gpu_victim_rate(now))
        running = [BatchEntry(l.req.adapter, l.req.rank, l.req.prompt + self._step - l.admitted_step)
                   for l in self._running.values()]
        running += [BatchEntry(l.req.adapter, l.req.rank, l.req.prompt) for l in self._prefilling]
        queued = tuple(BatchEntry(l.req.adapter, l.req.rank, l.req.prompt) for l in self._queue)
        slos = [l.req.slo.tpot_s for group in (self._running.values(), self._prefilling, self._queue) for l in group]
        state = WorkerState(
            address=self.address, base_model=self._base_model, kind=self._model.kind,
            running=tuple(running), queued=queued,
            gpu_adapters=self._tiers.gpu_adapters, host_adapters=self._tiers.host_adapters,
            gpu_adapter_slots=self._gpu_adapter_slots, max_batch=self._config.max_batch,
            free_kv_tokens=self._kv_free, tightest_tpot_slo_s=min(slos, default=None), timestamp=now,
            gpu_victim_rate=self._tiers.gpu_victim_rate(now))
        self._last_report = (self._events, state)
        return state

    def held_adapters(self) -> tuple[frozenset[str], frozenset[str]]:
        """(adapters on its GPU, adapters in its host memory)."""
        return self._tiers.gpu_adapters, self._tiers.host_adapters

    def gpu_adapter_bytes(self) -> int:
        return self._tiers.gpu_used

    def evictions(self, tier: Tier) -> int:
        return self._tiers.evictions[tier]
