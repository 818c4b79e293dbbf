"""ROCK's placement: adapters placed across the workers' tiers by popularity, not only found by routing.

`Popularity` keeps each adapter's request rate, decayed with a half-life, from the requests seen.
`plan_placement` turns the rates into a plan: hot adapters (the most requested, while the GPU tiers'
planned share has room) get GPU replicas on as many workers as their share of the work calls for (their
traffic share of the workers' busy time),
warm ones (the next, while the host tiers' planned share has room) a copy in a worker's host memory,
and the rest (cold) stay on disk, loaded on demand. Only part of each tier is planned: the rest is the
workers' own, for the loads requests bring, under their own eviction. A plan keeps an adapter where it is
held already when it can, so a new plan moves only what popularity moved (`moves` counts them). The
registry enacts plans through placement orders (preloads); the cluster simulator through its workers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

PlannedTier = Literal["gpu", "host", "disk"]


class Popularity:
    """Requests per second of each adapter, each request's weight halving every `half_life_s`."""

    def __init__(self, half_life_s: float = 60.0) -> None:
        assert half_life_s > 0
        self._decay = math.log(2) / half_life_s
        self._scores: dict[str, float] = {}  # the decayed count as of self._at
        self._at = 0.0

    def record(self, adapter: str, now: float, requests: float = 1.0) -> None:
        self._advance(now)
        self._scores[adapter] = self._scores.get(adapter, 0.0) + requests

    def rates(self, now: float) -> dict[str, float]:
        """Requests/s of each adapter seen (the decayed count × the decay rate: a steady rate r reads r)."""
        self._advance(now)
        return {adapter: score * self._decay for adapter, score in self._scores.items()}

    def _advance(self, now: float) -> None:
        if now > self._at:
            factor = math.exp(-self._decay * (now - self._at))
            self._scores = {a: s * factor for a, s in self._scores.items() if s * factor > 1e-6}
            self._at = now


class BusyTime:
    """How many workers' worth of time the workers spend stepping: each worker's busy seconds per second,
    decayed with a half-life as `Popularity` decays requests (one busy burst between two readings does not
    read as a busy cluster), summed over the workers read now. From their busy-seconds counters (each since
    its start): a worker's first reading, or a counter that went down (a restart), counts from the next."""

    def __init__(self, half_life_s: float) -> None:
        self._last: dict[str, tuple[float, float]] = {}  # worker -> (its counter, when read)
        self._busy = Popularity(half_life_s)  # worker -> busy seconds, decayed: its busy fraction

    def busy_workers(self, counters: Mapping[str, float], now: float) -> float:
        for worker, counter in counters.items():
            last = self._last.get(worker)
            if last is not None and counter >= last[0] and now > last[1]:
                # Async steps overlap: no more than the wall time between the readings.
                self._busy.record(worker, now, min(counter - last[0], now - last[1]))
            self._last[worker] = (counter, now)
        for gone in self._last.keys() - counters.keys():
            del self._last[gone]
        fractions = self._busy.rates(now)
        return sum(fractions.get(worker, 0.0) for worker in counters)


@dataclass(frozen=True)
class WorkerRoom:
    name: str
    gpu_bytes: int   # its GPU adapter tier
    host_bytes: int  # its host adapter tier (holds a copy of every GPU adapter too)


@dataclass(frozen=True)
class PlacementPlan:
    gpu: Mapping[str, tuple[str, ...]] = field(default_factory=dict)   # hot adapter -> its GPU replicas' workers
    host: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # warm adapter -> workers holding it in host

    def tier_of(self, adapter: str) -> PlannedTier:
        return "gpu" if adapter in self.gpu else "host" if adapter in self.host else "disk"

    def on_worker(self, worker: str) -> tuple[list[str], list[str]]:
        """(adapters planned on its GPU, adapters planned in its host memory only)."""
        return ([a for a, ws in self.gpu.items() if worker in ws], [a for a, ws in self.host.items() if worker in ws])

    def moves(self, before: PlacementPlan) -> int:
        """Replicas this plan adds over `before` (what enacting it loads)."""
        return sum(len(set(ws) - set(before.gpu.get(a, ()))) for a, ws in self.gpu.items()) + \
            sum(len(set(ws) - set(before.host.get(a, ())) - set(before.gpu.get(a, ()))) for a, ws in self.host.items())


@dataclass(frozen=True)
class PlanLimits:
    # Defaults: the 60-worker simulation's setting (docs/benchmarks/routing.md). Planned replicas are
    # preloads, never pinned, so a full plan never keeps a request's own load out.
    gpu_share: float = 0.9   # of each worker's GPU tier the plan may fill; the rest serves on-demand loads
    host_share: float = 0.5  # of each host tier, beyond its GPU replicas' copies
    min_rate: float = 0.0    # requests/s below which an adapter is cold whatever the room
    # GPU replicas per busy worker's worth of traffic share (more: holders to spare). 20 in the 60-worker
    # simulation, whose workers are 50-72% busy: about the replicas that 8 per worker's worth gave there.
    replica_factor: float = 20.0

    def __post_init__(self) -> None:
        assert 0 <= self.gpu_share <= 1 and 0 <= self.host_share <= 1 and self.min_rate >= 0


def replicas_for(rate: float, total_rate: float, workers: int, busy_workers: float, factor: float = 1.0) -> int:
    """GPU replicas of an adapter with `rate` of the `total_rate`: `factor` times its share of the work, the
    `busy_workers` (the workers' busy fractions summed), one at least and one per worker at most. So an idle
    cluster keeps one copy of each adapter, whose GPU room then holds more different adapters, and a busy one
    spreads its hot adapters' traffic."""
    if total_rate <= 0:
        return 1
    return max(1, min(workers, math.ceil(factor * busy_workers * rate / total_rate)))


def plan_placement(rates: Mapping[str, float], sizes: Mapping[str, int], workers: Iterable[WorkerRoom],
                   held: Mapping[str, Iterable[str]] | None = None, limits: PlanLimits = PlanLimits(),
                   in_host: Mapping[str, Iterable[str]] | None = None, busy_workers: float | None = None) -> PlacementPlan:
    """Hot, warm and cold adapters, most requested first. `sizes`: each adapter's bytes in a tier;
    `held`: adapter -> workers holding it on the GPU now, `in_host`: in host memory (preferred for its
    replicas and its copy, so plans move little and load from host memory where they do). `busy_workers`:
    how many workers' worth of time they spent stepping lately (None: all of them, a cluster at full load).
    Coverage before replicas: every adapter gets one GPU replica, most requested first, while the planned
    GPU share has room, and only the room left takes the hot ones' further replicas; so tight tiers hold as
    many different adapters as they can, and roomy ones also spread the hot adapters' traffic."""
    rooms = sorted(workers, key=lambda w: w.name)
    if not rooms:
        return PlacementPlan()
    held = {a: set(ws) for a, ws in (held or {}).items()}
    in_host = {a: set(ws) for a, ws in (in_host or {}).items()}
    gpu_free = {w.name: limits.gpu_share * w.gpu_bytes for w in rooms}
    host_free = {w.name: limits.host_share * w.host_bytes for w in rooms}
    load = {w.name: 0.0 for w in rooms}  # planned traffic per worker: replicas go where there is least
    ranked = sorted((a for a, r in rates.items() if r > limits.min_rate and a in sizes), key=lambda a: (-rates[a], a))
    total = sum(rates[a] for a in ranked)
    gpu: dict[str, list[str]] = {}

    def add_replica(adapter: str) -> bool:
        """One more GPU replica of `adapter` on the fitting worker that holds it or is least loaded."""
        holders = gpu.setdefault(adapter, [])
        fitting = [w.name for w in rooms if gpu_free[w.name] >= sizes[adapter] and w.name not in holders]
        if not fitting:
            return False
        worker = min(fitting, key=lambda w: (w not in held.get(adapter, ()), w not in in_host.get(adapter, ()),
                                             load[w], w))
        for w in holders:  # its traffic now splits one way more
            load[w] -= rates[adapter] / len(holders) - rates[adapter] / (len(holders) + 1)
        holders.append(worker)
        gpu_free[worker] -= sizes[adapter]  # (a GPU replica's host copy lies outside the planned host share)
        load[worker] += rates[adapter] / len(holders)
        return True

    covered = 0
    while covered < len(ranked) and add_replica(ranked[covered]):
        covered += 1
    gpu = {a: ws for a, ws in gpu.items() if ws}  # the first adapter that found no room
    for adapter in ranked[:covered]:
        want = replicas_for(rates[adapter], total, len(rooms), len(rooms) if busy_workers is None else busy_workers,
                            limits.replica_factor)
        while len(gpu[adapter]) < want and add_replica(adapter):
            pass
    host: dict[str, tuple[str, ...]] = {}
    for adapter in ranked[covered:]:
        size = sizes[adapter]
        fitting = [w for w in host_free if host_free[w] >= size]
        if not fitting:
            break
        worker = min(fitting, key=lambda w: (w not in in_host.get(adapter, ()), load[w], -host_free[w], w))
        host_free[worker] -= size
        load[worker] += rates[adapter]
        host[adapter] = (worker,)
    return PlacementPlan({a: tuple(sorted(ws)) for a, ws in gpu.items()}, host)
