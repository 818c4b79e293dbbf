"""One simulated worker's adapter loads, staged as the real worker stages them.

A request pins its adapter from arrival to its end, and a missing adapter's load starts at arrival:
disk -> host on one of `loader_threads` loader threads (read, sha256, parse; `LoadCosts.disk_to_host_s`),
then host -> GPU on the one copy stream, FIFO (`LoadCosts.host_to_gpu_s`). Memory is the shared
`AdapterTiers`, in bytes: host bytes are reserved when the adapter enters the loaders' queue, GPU bytes
when its copy starts. When pinned adapters fill a tier the load waits at the head of its queue until an
unpin frees room (FIFO: nothing overtakes it).

    arrival ─▶ host wait ─▶ loader queue ─▶ loader thread ×N ─▶ copy queue ─▶ copy stream ─▶ ready
               (host room)                                      (GPU room)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from policy.adapter_tiers import AdapterTiers, LoadCosts, Tier

Schedule = Callable[[float, Callable[[float], None]], None]  # run callback(time) at time
Changed = Callable[[float], None]                            # a load advanced a stage at this time


class SimLoads:
    def __init__(self, tiers: AdapterTiers, costs: LoadCosts, loader_threads: int, schedule: Schedule,
                 changed: Changed) -> None:
        assert loader_threads >= 1, "a worker needs a loader thread"
        self._tiers = tiers
        self._costs = costs
        self._threads = loader_threads
        self._schedule = schedule
        self._changed = changed
        self._ranks: dict[str, int] = {}
        self._loading: set[str] = set()        # in any stage below, until its copy ends
        self._host_wait: deque[str] = deque()  # on disk, waiting for host room
        self._to_read: deque[str] = deque()    # host bytes reserved, waiting for a loader thread
        self._reading = 0                      # loader threads busy
        self._to_copy: deque[str] = deque()    # in host memory, waiting for GPU room and the copy stream
        self._copying = False
        self._placement_reads: set[str] = set()  # reads a placement started (pinned by it until read)
        self._host_only: set[str] = set()        # of those, the ones going no further than host memory

    def acquire(self, adapter: str, rank: int, now: float, access: bool = True) -> bool:
        """A request for `adapter` arrived (`access`; else a placement's preload): count the access, pin it,
        start its load if it is neither on the GPU nor on its way there. Returns whether it was ready (a hit)."""
        if access:
            self._tiers.touch(adapter, now)
        self._tiers.pin(adapter)
        if self.ready(adapter):
            return True
        if adapter in self._host_only:  # a placement's read under way: the request takes it on to the GPU
            self._host_only.discard(adapter)
        elif adapter not in self._loading:
            self._ranks[adapter] = rank
            self._loading.add(adapter)
            (self._to_copy if self._tiers.tier(adapter) is Tier.HOST else self._host_wait).append(adapter)
            self._advance(now)
        return False

    def release(self, adapter: str, now: float) -> None:
        """A request for `adapter` ended; its memory may be what a waiting load needs."""
        self._tiers.unpin(adapter)
        if self._host_wait or self._to_copy:
            self._advance(now)

    def ready(self, adapter: str) -> bool:
        return adapter not in self._loading and self._tiers.tier(adapter) is Tier.GPU

    def preload_host(self, adapter: str, rank: int, now: float) -> None:
        """A placement's warm adapter: read from disk into host memory (evicting there as a request's load
        would) on a loader thread, no further; a no-op where it is in host memory or on its way."""
        if adapter in self._loading or self._tiers.tier(adapter) is not Tier.DISK:
            return
        self._ranks[adapter] = rank
        self._loading.add(adapter)
        self._tiers.pin(adapter)  # no other load evicts it halfway
        self._placement_reads.add(adapter)
        self._host_only.add(adapter)
        self._host_wait.append(adapter)
        self._advance(now)

    def idle(self) -> bool:
        """No load in flight or waited for."""
        return not self._loading

    def room_below(self, adapter: str, rank: int, tier: Tier) -> bool:
        """Whether `adapter` could reach `tier` displacing only colder adapters (a placement's preload, as
        the real worker's AdapterManager decides it)."""
        nbytes = self._costs.adapter_bytes(rank)
        if self._tiers.tier(adapter) is Tier.DISK and not self._tiers.room_for(adapter, Tier.HOST, nbytes):
            return False
        return tier is Tier.HOST or self._tiers.room_for(adapter, Tier.GPU, nbytes)

    def stage(self, adapter: str, rank: int) -> bool:
        """Initial placement, no request: `adapter` into free host memory; returns whether it is there."""
        return self._tiers.stage_in_host(adapter, self._costs.adapter_bytes(rank))

    def _advance(self, now: float) -> None:
        """Start whatever can start now, in queue order."""
        while self._host_wait and self._tiers.place_in_host(
                self._host_wait[0], self._costs.adapter_bytes(self._ranks[self._host_wait[0]])) is not None:
            self._to_read.append(self._host_wait.popleft())
        while self._to_read and self._reading < self._threads:
            adapter = self._to_read.popleft()
            self._reading += 1
            self._schedule(now + self._costs.disk_to_host_s(self._ranks[adapter]),
                           lambda t, a=adapter: self._read_done(a, t))
        if not self._copying and self._to_copy and self._tiers.place_on_gpu(self._to_copy[0]) is not None:
            adapter = self._to_copy.popleft()
            self._copying = True
            self._schedule(now + self._costs.host_to_gpu_s(self._ranks[adapter]),
                           lambda t, a=adapter: self._copy_done(a, t))

    def _read_done(self, adapter: str, now: float) -> None:
        self._reading -= 1
        if adapter in self._placement_reads:
            self._placement_reads.discard(adapter)
            self._tiers.unpin(adapter)
        if adapter in self._host_only:
            self._host_only.discard(adapter)
            self._loading.discard(adapter)
        else:
            self._to_copy.append(adapter)
        self._advance(now)
        self._changed(now)

    def _copy_done(self, adapter: str, now: float) -> None:
        self._copying = False
        self._loading.discard(adapter)
        self._advance(now)
        self._changed(now)
