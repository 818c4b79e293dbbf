"""policy/simulator/loads.py: the simulated worker's two load stages (disk -> host on loader
threads, host -> GPU on one FIFO copy stream) over `AdapterTiers`, timed by hand from `LoadCosts`."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

import pytest

from policy.simulator.loads import SimLoads
from policy.adapter_tiers import AdapterTiers, LoadCosts, Tier
from policy.eviction import LFUDecay

MIB = 2**20
RANK = 16
NBYTES = RANK * 2 * MIB
DISK_S = 20e-3 + NBYTES / 1.5e9   # one loader thread's read + sha256 of one adapter
COPY_S = 0.5e-3 + NBYTES / 25e9   # one host -> GPU copy


class Clock:
    """An event heap, and when each adapter became ready."""

    def __init__(self) -> None:
        self.events: list[tuple[float, int, Callable[[float], None]]] = []
        self.order = itertools.count()
        self.ready_at: dict[str, float] = {}
        self.loads: SimLoads | None = None

    def schedule(self, at: float, callback: Callable[[float], None]) -> None:
        heapq.heappush(self.events, (at, next(self.order), callback))

    def changed(self, now: float) -> None:
        for adapter in ("a", "b", "c"):
            if adapter not in self.ready_at and self.loads.ready(adapter):
                self.ready_at[adapter] = now

    def run_until(self, until: float = float("inf")) -> None:
        while self.events and self.events[0][0] <= until:
            at, _, callback = heapq.heappop(self.events)
            callback(at)


def loads(gpu_adapters: int, host_adapters: int, threads: int) -> tuple[SimLoads, AdapterTiers, Clock]:
    clock = Clock()
    tiers = AdapterTiers(gpu_adapters * NBYTES, host_adapters * NBYTES, LFUDecay(60.0))
    clock.loads = SimLoads(tiers, LoadCosts(), threads, clock.schedule, clock.changed)
    return clock.loads, tiers, clock


@pytest.mark.parametrize("threads, expected", [
    (2, {"a": DISK_S + COPY_S, "b": DISK_S + 2 * COPY_S, "c": 2 * DISK_S + COPY_S}),
    (1, {"a": DISK_S + COPY_S, "b": 2 * DISK_S + COPY_S, "c": 3 * DISK_S + COPY_S}),
])
def test_reads_run_on_loader_threads_and_copies_one_at_a_time(threads: int, expected: dict[str, float]) -> None:
    sim, tiers, clock = loads(gpu_adapters=3, host_adapters=3, threads=threads)
    assert not any(sim.acquire(a, RANK, 0.0) for a in "abc")   # cold: all three misses
    assert not sim.acquire("a", RANK, 0.0)                       # joining a load in flight is a miss, not a second load
    clock.run_until()
    assert clock.ready_at == pytest.approx(expected)
    assert sim.acquire("a", RANK, 1.0) and tiers.gpu_used == 3 * NBYTES


def test_a_host_copy_skips_the_disk_stage() -> None:
    sim, _, clock = loads(gpu_adapters=1, host_adapters=2, threads=2)
    assert sim.stage("a", RANK)
    sim.acquire("a", RANK, 0.0)
    clock.run_until()
    assert clock.ready_at == pytest.approx({"a": COPY_S})


def test_a_copy_waits_for_gpu_memory_held_by_a_pinned_adapter() -> None:
    sim, tiers, clock = loads(gpu_adapters=1, host_adapters=2, threads=2)
    sim.acquire("a", RANK, 0.0)
    clock.run_until()
    sim.acquire("b", RANK, 1.0)
    clock.run_until(2.0)                  # b is read into host memory, but a's request still holds the GPU
    assert tiers.tier("b") is Tier.HOST and "b" not in clock.ready_at
    sim.release("a", 2.0)                 # a leaves the GPU (its host copy stays), b's copy starts
    clock.run_until()
    assert clock.ready_at["b"] == pytest.approx(2.0 + COPY_S)
    assert tiers.tier("a") is Tier.HOST and tiers.evictions[Tier.GPU] == 1


def test_a_read_waits_for_host_memory_held_by_pinned_adapters() -> None:
    sim, tiers, clock = loads(gpu_adapters=1, host_adapters=1, threads=2)
    sim.acquire("a", RANK, 0.0)
    sim.acquire("b", RANK, 0.0)           # no host room: b does not start reading
    clock.run_until(1.0)
    assert tiers.tier("b") is Tier.DISK and clock.ready_at == pytest.approx({"a": DISK_S + COPY_S})
    sim.release("a", 1.0)
    clock.run_until()
    assert clock.ready_at["b"] == pytest.approx(1.0 + DISK_S + COPY_S)
    assert tiers.tier("a") is Tier.DISK and tiers.evictions == {Tier.GPU: 1, Tier.HOST: 1}
