"""The simulated cluster: N workers, one gateway, one event queue in virtual time.

The gateway part is the real scheduling core: a `WorkerStateTable` on the virtual clock, fed by
each worker's push every `report_interval_s` (staggered), and a `Policy` choosing among its fresh
candidates. The gateway's estimate of a response's length is the running mean of the responses
completed so far (a prior of 128 tokens before the first one); it never sees a request's own.
"""

from __future__ import annotations

import heapq
import itertools
import math
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from policy.simulator.worker import SimWorker, WorkerConfig
from policy.simulator.workload import SimRequest
from policy.adapter_tiers import LoadCosts, Tier
from policy.eviction import LRU, Eviction, LFUDecay
from policy.perf_model import PerfModel
from policy.placement import (BusyTime, PlacementPlan, PlanLimits, Popularity, WorkerRoom,
                              plan_placement)
from policy.routing.policies import Policy, RoutingRequest
from policy.routing.worker_state import WorkerStateTable

OUTPUT_PRIOR_TOKENS = 128
EVICTIONS = ("lfu", "lru")


@dataclass(frozen=True)
class ClusterConfig:
    workers: int = 60
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    eviction: str = "lfu"
    lfu_half_life_s: float = 60.0
    report_interval_s: float = 0.1
    stale_after_s: float = 0.5
    base_model: str = "llama-2-7b"
    host_copies: int = 1  # at the start, every adapter sits in this many workers' host memory

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"need at least one worker, got {self.workers}")
        if not 0 <= self.host_copies <= self.workers:
            raise ValueError(f"host copies must be in [0, workers], got {self.host_copies}")
        if self.eviction not in EVICTIONS:
            raise ValueError(f"eviction must be one of {EVICTIONS}, got '{self.eviction}'")
        if not 0 < self.report_interval_s < self.stale_after_s:
            raise ValueError("workers must report more often than the staleness bound "
                             f"({self.report_interval_s} s vs {self.stale_after_s} s)")

    def eviction_policy(self) -> Eviction:
        return LFUDecay(self.lfu_half_life_s) if self.eviction == "lfu" else LRU()


@dataclass(frozen=True)
class PlacementConfig:
    """ROCK's placement (policy/placement.py), re-planned every `every_s` from the
    request rates seen (decayed with `half_life_s`), enacted on the workers as the registry's orders are."""
    every_s: float = 30.0
    half_life_s: float = 60.0
    limits: PlanLimits = field(default_factory=PlanLimits)
    heartbeat_s: float = 1.0  # each worker's heartbeat: its answer carries the orders again (RegistryConfig)


@dataclass(frozen=True)
class RunResult:
    policy: str
    requests: int
    slo_attainment: float   # fraction meeting both SLOs
    ttft_attainment: float
    tpot_attainment: float
    ttft_mean_s: float
    ttft_p99_s: float
    tpot_mean_s: float
    tpot_p99_s: float
    hit_rate: float         # requests whose adapter was ready on the chosen worker's GPU on arrival
    hit_ceiling: float      # requests that are not their adapter's first ever: the most any policy hits
    placement_moves: int    # replicas the placement plans added (0 without placement)
    gpu_adapter_gb: float   # adapters' GPU memory per worker, time-averaged
    gpu_evictions: int      # over all workers
    host_evictions: int
    utilisation: float      # busy (stepping) fraction of the run, averaged over workers
    duration_s: float       # virtual seconds, first arrival to last completion
    wall_s: float


class _Metrics:
    def __init__(self, total: int) -> None:
        self.ttft = np.full(total, np.nan)
        self.tpot = np.full(total, np.nan)
        self.met = np.zeros((total, 2), dtype=bool)  # ttft ok, tpot ok
        self.hits = 0
        self.done = 0
        self.output_tokens = 0
        self.gpu_bytes = 0.0
        self.gpu_samples = 0
        self.last_finish_s = 0.0

    def finished(self, req: SimRequest, first_token_s: float, finish_s: float) -> None:
        ttft = first_token_s - req.arrival_s
        tpot = (finish_s - first_token_s) / (req.output - 1) if req.output > 1 else 0.0
        self.ttft[req.index], self.tpot[req.index] = ttft, tpot
        self.met[req.index] = (ttft <= req.slo.ttft_s, tpot <= req.slo.tpot_s)
        self.done += 1
        self.output_tokens += req.output
        self.last_finish_s = max(self.last_finish_s, finish_s)

    def expected_output(self) -> int:
        return round(self.output_tokens / self.done) if self.done else OUTPUT_PRIOR_TOKENS


def simulate(requests: Sequence[SimRequest], adapters: Mapping[str, int], policy: Policy, model: PerfModel,
             load_costs: LoadCosts, config: ClusterConfig, progress: Callable[[str], None] | None = None,
             placement: PlacementConfig | None = None) -> RunResult:
    """Replay `requests` (arrival order, indices 0..n-1) through `policy`; metrics over all of them.
    `adapters` maps each adapter to its LoRA rank. The run starts with empty GPU tiers and `adapters`
    staged round-robin in the host tiers (the registry's placement of a service that has been up
    before; `host_copies=0` starts cold); with `placement`, adapters are also placed by popularity."""
    assert all(r.index == i for i, r in enumerate(requests)), "request indices must be 0..n-1 in order"
    too_long = [r.index for r in requests if r.prompt + r.output > config.worker.kv_tokens]
    if too_long:
        raise ValueError(f"{len(too_long)} requests need more KV than a worker has "
                         f"({config.worker.kv_tokens} tokens), e.g. request {too_long[0]}")
    largest = max([*adapters.values(), *(r.rank for r in requests)], default=0)
    if load_costs.adapter_bytes(largest) > config.worker.gpu_adapter_bytes:
        raise ValueError(f"a rank-{largest} adapter ({load_costs.adapter_bytes(largest)} B) does not fit a worker's "
                         f"GPU adapter memory ({config.worker.gpu_adapter_bytes} B)")
    started = time.perf_counter()
    events: list[tuple[float, int, Callable[[float], None]]] = []
    order = itertools.count()
    now = 0.0

    def schedule(at: float, callback: Callable[[float], None]) -> None:
        heapq.heappush(events, (at, next(order), callback))

    metrics = _Metrics(len(requests))
    table = WorkerStateTable(clock=lambda: now, stale_after_s=config.stale_after_s)
    workers = {}
    for i in range(config.workers):
        worker = SimWorker(f"w{i:03d}", config.base_model, model, load_costs, config.eviction_policy(), config.worker,
                           schedule, metrics.finished, clock=lambda: now)
        workers[worker.address] = worker
    _stage(adapters, list(workers.values()), config)
    for worker in workers.values():
        table.report(worker.report(now))

    def push_report(worker: SimWorker) -> Callable[[float], None]:
        def report(t: float) -> None:
            table.report(worker.report(t))
            metrics.gpu_bytes += worker.gpu_adapter_bytes()
            metrics.gpu_samples += 1
            if metrics.done < len(requests):
                schedule(t + config.report_interval_s, report)
        return report

    for i, worker in enumerate(workers.values()):
        schedule(config.report_interval_s * (i + 1) / config.workers, push_report(worker))

    popularity = Popularity(placement.half_life_s) if placement else None
    moves = 0
    if placement is not None:
        sizes = {adapter: load_costs.adapter_bytes(rank) for adapter, rank in adapters.items()}
        rooms = [WorkerRoom(address, config.worker.gpu_adapter_bytes, config.worker.host_adapter_bytes)
                 for address in workers]
        last = PlacementPlan()
        busy = BusyTime(placement.half_life_s)
        busy.busy_workers({address: 0.0 for address in workers}, 0.0)

        def replan(t: float) -> None:
            nonlocal last, moves
            busy_workers = busy.busy_workers({w.address: w.busy_s for w in workers.values()}, t)
            on_gpu: dict[str, list[str]] = {}
            in_host: dict[str, list[str]] = {}
            for worker in workers.values():
                gpu, host = worker.held_adapters()
                for adapter in gpu:
                    on_gpu.setdefault(adapter, []).append(worker.address)
                for adapter in host:
                    in_host.setdefault(adapter, []).append(worker.address)
            rates = popularity.rates(t)
            plan = plan_placement(rates, sizes, rooms, on_gpu, placement.limits, in_host, busy_workers)
            for worker in workers.values():
                gpu, host = plan.on_worker(worker.address)  # each GPU replica expects its share of the rate
                worker.place([(a, adapters[a], rates[a] / len(plan.gpu[a])) for a in gpu],
                             [(a, adapters[a], rates[a]) for a in host], t)
            moves += plan.moves(last)
            last = plan
            if metrics.done < len(requests):
                schedule(t + placement.every_s, replan)
        schedule(placement.every_s, replan)

        def heartbeat(worker: SimWorker) -> Callable[[float], None]:
            def answer(t: float) -> None:  # the registry's answer carries the plan's orders again
                worker.answer(t)
                if metrics.done < len(requests):
                    schedule(t + placement.heartbeat_s, answer)
            return answer
        for i, worker in enumerate(workers.values()):
            schedule(placement.heartbeat_s * (i + 1) / config.workers, heartbeat(worker))

    next_progress = started + 2.0
    for req in requests:
        while events and events[0][0] <= req.arrival_s:
            now, _, callback = heapq.heappop(events)
            callback(now)
        now = req.arrival_s
        if popularity is not None:
            popularity.record(req.adapter, now)
        routed = RoutingRequest(req.adapter, req.rank, req.prompt, metrics.expected_output(), req.slo)
        chosen = policy.choose(routed, table.candidates(config.base_model))
        table.dispatched(chosen.address, routed.entry, req.slo.tpot_s)
        metrics.hits += workers[chosen.address].receive(req, now)
        if progress is not None and time.perf_counter() >= next_progress:
            next_progress += 2.0
            progress(f"{policy.name}: {req.index + 1}/{len(requests)} routed, {now:.0f} s simulated")
    while events:
        now, _, callback = heapq.heappop(events)
        callback(now)
    assert metrics.done == len(requests), f"{len(requests) - metrics.done} requests never finished"

    duration = metrics.last_finish_s - requests[0].arrival_s
    ttft_ok, tpot_ok = metrics.met[:, 0], metrics.met[:, 1]
    return RunResult(
        policy=policy.name, requests=len(requests),
        slo_attainment=float(np.mean(ttft_ok & tpot_ok)),
        ttft_attainment=float(np.mean(ttft_ok)), tpot_attainment=float(np.mean(tpot_ok)),
        ttft_mean_s=float(np.mean(metrics.ttft)), ttft_p99_s=float(np.percentile(metrics.ttft, 99)),
        tpot_mean_s=float(np.mean(metrics.tpot)), tpot_p99_s=float(np.percentile(metrics.tpot, 99)),
        hit_rate=metrics.hits / len(requests),
        hit_ceiling=1.0 - len({r.adapter for r in requests}) / len(requests), placement_moves=moves,
        gpu_adapter_gb=metrics.gpu_bytes / max(1, metrics.gpu_samples) / 1e9,
        gpu_evictions=sum(w.evictions(Tier.GPU) for w in workers.values()),
        host_evictions=sum(w.evictions(Tier.HOST) for w in workers.values()),
        utilisation=float(np.mean([w.busy_s for w in workers.values()])) / duration if duration > 0 else math.nan,
        duration_s=duration, wall_s=time.perf_counter() - started)


def _stage(adapters: Mapping[str, int], workers: list[SimWorker], config: ClusterConfig) -> None:
    stride = len(workers) // max(1, config.host_copies)  # copies of one adapter on workers far apart
    for i, (adapter, rank) in enumerate(adapters.items()):
        for copy in range(config.host_copies):
            worker = workers[(i + copy * stride) % len(workers)]
            if not worker.stage(adapter, rank):
                raise ValueError(f"{config.host_copies} host copies of {len(adapters)} adapters do not fit "
                                 f"{config.worker.host_adapter_bytes / 2**30:g} GiB of host adapter memory "
                                 f"per worker ({worker.address} is full)")


def stderr_progress(line: str) -> None:
    print(f"\r{line}   ", end="", file=sys.stderr, flush=True)
