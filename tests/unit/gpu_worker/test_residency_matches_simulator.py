"""The simulator's workers decide adapter residency as the real worker does: one script of requests and
placement orders, played through the cluster simulator's loads (policy/simulator/loads.py, on its event
clock) and replayed through the real worker's AdapterManager (loader threads, the tiny CPU GPU tier),
with each read completing when it completed in the simulation, gives the same loads, slots, evictions,
hits and tiers."""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass

from gpu_worker.lora.adapter_manager import AdapterManager
from gpu_worker.lora.loader import AdapterRef, LoRAWeights
from policy.adapter_tiers import LoadCosts
from policy.eviction import LRU
from policy.placement_orders import OrderBook, PlacementOrders, Preload
from policy.simulator.loads import SimAdapter, SimLoads
from tests.unit.gpu_worker.adapter_fakes import MAX_RANK, Clock, Disk, manager, poll_until, ref

GPU_SLOTS, HOST_SLOTS = 2, 3
NAMES = "abcde"


@dataclass(frozen=True)
class Step:
    at: float
    kind: str  # "arrive", "depart", "orders", or "read" (a read completing: from the simulation's run)
    name: str = ""


SCRIPT = [  # requests for five adapters on a worker with room for two on its GPU, three in host memory
    Step(0.0, "arrive", "a"), Step(0.0, "arrive", "b"), Step(0.0, "arrive", "c"),
    Step(1.0, "depart", "a"),             # c takes a's GPU room
    Step(2.0, "arrive", "a"),             # a waits: both GPU adapters are held
    Step(3.0, "depart", "b"),
    Step(4.0, "orders", "d"),             # a placement plan: d into host memory, hot
    Step(5.0, "depart", "c"), Step(5.0, "depart", "a"),
    Step(6.0, "orders", "e"),             # e onto the GPU, displacing a colder adapter
    Step(7.0, "arrive", "d"), Step(7.0, "arrive", "e"), Step(7.0, "arrive", "b"),
    Step(8.0, "depart", "d"), Step(8.0, "depart", "e"), Step(8.0, "depart", "b"),
]


class GatedDisk(Disk):
    """Each read waits until its step lets one read of its adapter through."""

    def __init__(self, digests: list[str]) -> None:
        super().__init__()
        self.gates = {digest: threading.Semaphore(0) for digest in digests}

    def read(self, adapter: AdapterRef) -> LoRAWeights:
        assert self.gates[adapter.sha256].acquire(timeout=10), f"the read of {adapter.name} was never let through"
        return super().read(adapter)


def orders(name: str, refer: Callable[[str], object]) -> PlacementOrders:
    if name == "d":
        return PlacementOrders(host_preloads=(Preload(refer("d"), rate=5.0),))
    return PlacementOrders(preloads=(Preload(refer("e"), rate=5.0),), host_preloads=(Preload(refer("d"), rate=5.0),))


def record(port: object, names: Callable[[str], str], decisions: list[tuple]) -> None:
    """Log every decision the residency hands `port` (reads, copies and what they release), in order."""
    start_read, start_copy = port.start_read, port.start_copy
    release_slot, release_host = port.release_slot, port.release_host
    port.start_read = lambda r: (decisions.append(("read", r.name)), start_read(r))[1]
    port.start_copy = lambda r, slot: (decisions.append(("copy", r.name, slot)), start_copy(r, slot))[1]
    port.release_slot = lambda slot: (decisions.append(("free slot", slot)), release_slot(slot))[1]
    port.release_host = lambda digest: (decisions.append(("free host", names(digest))), release_host(digest))[1]


def simulate(nbytes: int) -> tuple[list[tuple], list[Step], dict]:
    """The script through the simulator: its decisions, the script with its read completions, its tiers."""
    events: list[tuple[float, int, Callable[[float], None]]] = []
    order = itertools.count()
    clock = Clock()
    costs = LoadCosts(bytes_per_rank=nbytes // MAX_RANK, host_fixed_s=0.0, host_bytes_per_s=float("inf"),
                      disk_fixed_s=0.1, disk_bytes_per_s=float("inf"))
    sim = SimLoads(GPU_SLOTS * nbytes, HOST_SLOTS * nbytes, LRU(), costs, 2,
                   lambda at, callback: heapq.heappush(events, (at, next(order), callback)), lambda now: None, clock)
    residency = sim.residency
    book = OrderBook(residency)
    decisions: list[tuple] = []
    record(sim, lambda digest: digest, decisions)
    played: list[Step] = []
    read_done = residency.read_done

    def reported(digest: str, *args: int) -> bool:
        played.append(Step(clock.now, "read", digest))
        return read_done(digest, *args)
    residency.read_done = reported

    def run_until(at: float) -> None:
        while events and events[0][0] <= at:
            clock.now, _, callback = heapq.heappop(events)
            callback(clock.now)
        clock.now = at

    for step in SCRIPT:
        run_until(step.at)
        played.append(step)
        adapter = SimAdapter(step.name, MAX_RANK)
        if step.kind == "arrive":
            decisions.append(("hit" if residency.arrive(adapter) else "miss", step.name))
        elif step.kind == "depart":
            residency.depart(adapter)
            residency.advance()
        else:
            book.apply(orders(step.name, lambda name: SimAdapter(name, MAX_RANK)))
            residency.advance()
    run_until(float("inf"))
    tiers = residency.tiers
    return decisions, played, {"gpu": tiers.gpu_adapters, "host": tiers.host_adapters, "evictions": tiers.evictions}


def replay(played: list[Step]) -> tuple[list[tuple], dict, AdapterManager]:
    """The same steps through the real worker's adapter manager, each read completing where it did."""
    refs = {name: ref(name) for name in NAMES}
    disk, clock = GatedDisk([r.sha256 for r in refs.values()]), Clock()
    adapters, _ = manager(GPU_SLOTS, disk, host_slots=HOST_SLOTS, eviction=LRU(), clock=clock)
    by_digest = {r.sha256: name for name, r in refs.items()}
    decisions: list[tuple] = []
    record(adapters, by_digest.__getitem__, decisions)
    book = OrderBook(adapters.residency)
    for step in played:
        clock.now = step.at
        if step.kind == "arrive":
            hits = adapters.residency.hits
            adapters.arrive(refs[step.name])
            decisions.append(("hit" if adapters.residency.hits > hits else "miss", step.name))
        elif step.kind == "depart":
            adapters.depart(refs[step.name])
            adapters.poll()
        elif step.kind == "orders":
            book.apply(orders(step.name, refs.__getitem__))
            adapters.poll()
        else:
            disk.gates[refs[step.name].sha256].release()
            poll_until(adapters, lambda: adapters.residency.status(refs[step.name]).in_host)
    tiers = adapters.residency.tiers
    names = lambda digests: frozenset(by_digest[d] for d in digests)  # noqa: E731
    return decisions, {"gpu": names(tiers.gpu_adapters), "host": names(tiers.host_adapters),
                       "evictions": tiers.evictions}, adapters


def test_the_simulator_and_the_worker_make_the_same_residency_decisions() -> None:
    adapters, _ = manager(GPU_SLOTS, Disk(), host_slots=HOST_SLOTS)
    nbytes = adapters.residency.tiers.gpu_bytes // GPU_SLOTS  # one rank-MAX_RANK adapter, as the worker counts it
    adapters.close()
    simulated, played, sim_tiers = simulate(nbytes)
    replayed, worker_tiers, worker = replay(played)
    try:
        assert replayed == simulated
        assert worker_tiers == sim_tiers
    finally:
        worker.close()
    # The script exercises what it is for: waits for room, evictions from both tiers, both kinds of preload.
    assert ("copy", "c", 0) in simulated and ("copy", "e", 0) in simulated or ("copy", "e", 1) in simulated
    assert ("read", "d") in simulated and sim_tiers["evictions"][next(iter(sim_tiers["evictions"]))] > 0
