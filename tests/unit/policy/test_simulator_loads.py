"""policy/simulator/loads.py: the worker's residency driven on the simulated clock, its two load stages
(disk -> host on loader threads, host -> GPU on one in-order copy stream) timed by hand from `LoadCosts`."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

import pytest

from policy.adapter_tiers import LoadCosts, Tier
from policy.eviction import LFUDecay
from policy.simulator.loads import SimAdapter, SimLoads

MIB = 2**20
RANK = 16
NBYTES = RANK * 2 * MIB
DISK_S = 20e-3 + NBYTES / 1.5e9   # one loader thread's read + sha256 of one adapter
COPY_S = 0.5e-3 + NBYTES / 25e9   # one host -> GPU copy
A, B, C = (SimAdapter(name, RANK) for name in "abc")


class Clock:
    """An event heap, and when each adapter became ready."""

    def __init__(self) -> None:
        self.events: list[tuple[float, int, Callable[[float], None]]] = []
        self.order = itertools.count()
        self.now = 0.0
        self.ready_at: dict[str, float] = {}
        self.loads: SimLoads | None = None

    def schedule(self, at: float, callback: Callable[[float], None]) -> None:
        heapq.heappush(self.events, (at, next(self.order), callback))

    def changed(self, now: float) -> None:
        for adapter in (A, B, C):
            if adapter.name not in self.ready_at and self.loads.ready(adapter):
                self.ready_at[adapter.name] = now

    def run_until(self, until: float = float("inf")) -> None:
        while self.events and self.events[0][0] <= until:
            self.now, _, callback = heapq.heappop(self.events)
            callback(self.now)
        if until != float("inf"):
            self.now = until


def loads(gpu_adapters: int, host_adapters: int, threads: int) -> tuple[SimLoads, Clock]:
    clock = Clock()
    clock.loads = SimLoads(gpu_adapters * NBYTES, host_adapters * NBYTES, LFUDecay(60.0), LoadCosts(), threads,
                           clock.schedule, clock.changed, lambda: clock.now)
    return clock.loads, clock


def release(sim: SimLoads, adapter: SimAdapter) -> None:
    """A request for `adapter` ended, as the simulated worker reports it."""
    sim.residency.depart(adapter)
    sim.residency.advance()


@pytest.mark.parametrize("threads, expected", [
    (2, {"a": DISK_S + COPY_S, "b": DISK_S + 2 * COPY_S, "c": 2 * DISK_S + COPY_S}),
    (1, {"a": DISK_S + COPY_S, "b": 2 * DISK_S + COPY_S, "c": 3 * DISK_S + COPY_S}),
])
def test_reads_run_on_loader_threads_and_copies_one_at_a_time(threads: int, expected: dict[str, float]) -> None:
    sim, clock = loads(gpu_adapters=3, host_adapters=3, threads=threads)
    assert not any(sim.residency.arrive(a) for a in (A, B, C))   # cold: all three misses
    assert not sim.residency.arrive(A)                          # joining a load in flight is a miss, not a second load
    clock.run_until()
    assert clock.ready_at == pytest.approx(expected)
    clock.now = 1.0
    assert sim.residency.arrive(A) and sim.residency.tiers.gpu_used == 3 * NBYTES


def test_a_host_copy_skips_the_disk_stage() -> None:
    sim, clock = loads(gpu_adapters=1, host_adapters=2, threads=2)
    assert sim.stage(A) and sim.residency.tiers.tier("a") is Tier.HOST
    sim.residency.arrive(A)
    clock.run_until()
    assert clock.ready_at == pytest.approx({"a": COPY_S})


def test_staging_fills_only_free_host_memory() -> None:
    sim, _ = loads(gpu_adapters=1, host_adapters=2, threads=2)
    assert sim.stage(A) and sim.stage(B) and not sim.stage(C)
    assert sim.residency.tiers.host_adapters == {"a", "b"} and sim.residency.tiers.evictions[Tier.HOST] == 0


def test_a_copy_waits_for_gpu_memory_held_by_a_pinned_adapter() -> None:
    sim, clock = loads(gpu_adapters=1, host_adapters=2, threads=2)
    tiers = sim.residency.tiers
    sim.residency.arrive(A)
    clock.run_until()
    clock.now = 1.0
    sim.residency.arrive(B)
    clock.run_until(2.0)                  # b is read into host memory, but a's request still holds the GPU
    assert tiers.tier("b") is Tier.HOST and "b" not in clock.ready_at
    release(sim, A)                       # a leaves the GPU (its host copy stays), b's copy starts
    clock.run_until()
    assert clock.ready_at["b"] == pytest.approx(2.0 + COPY_S)
    assert tiers.tier("a") is Tier.HOST and tiers.evictions[Tier.GPU] == 1


def test_a_read_waits_for_host_memory_held_by_pinned_adapters() -> None:
    sim, clock = loads(gpu_adapters=1, host_adapters=1, threads=2)
    tiers = sim.residency.tiers
    sim.residency.arrive(A)
    sim.residency.arrive(B)               # no host room: b does not start reading
    clock.run_until(1.0)
    assert tiers.tier("b") is Tier.DISK and clock.ready_at == pytest.approx({"a": DISK_S + COPY_S})
    release(sim, A)
    clock.run_until()
    assert clock.ready_at["b"] == pytest.approx(1.0 + DISK_S + COPY_S)
    assert tiers.tier("a") is Tier.DISK and tiers.evictions == {Tier.GPU: 1, Tier.HOST: 1}
