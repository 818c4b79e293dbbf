"""One simulated worker's adapter loads: the real worker's residency (policy/residency.py) driven by the
event schedule, with the I/O timed from `LoadCosts` as the worker runs it:

    disk -> host  on `loader_threads` loader threads, first come first served (a read's sha256 and parse
                  included: `LoadCosts.disk_to_host_s`);
    host -> GPU   on the one copy stream, in order (`LoadCosts.host_to_gpu_s`).

Each completion is reported to the residency as the worker's poll reports it, then the residency starts
what has room now; every other change (a request arrives or ends, an order) is followed by the same pass.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from policy.adapter_tiers import LoadCosts
from policy.eviction import Eviction
from policy.load_failures import Failure
from policy.residency import Residency
from policy.residency_edge import ResidencyLimits, VersionRef

Schedule = Callable[[float, Callable[[float], None]], None]  # run callback(time) at time
Changed = Callable[[float], None]                            # a load advanced a stage at this time


@dataclass(frozen=True)
class SimAdapter:
    """A simulated adapter: one version, named by itself."""
    name: str
    rank: int
    registered_ms: int = 0

    @property
    def sha256(self) -> str:
        return self.name


class SimLoads:
    """The residency's port on the simulated clock."""

    def __init__(self, gpu_bytes: int, host_bytes: int, eviction: Eviction, costs: LoadCosts, loader_threads: int,
                 schedule: Schedule, changed: Changed, clock: Callable[[], float]) -> None:
        assert loader_threads >= 1, "a worker needs a loader thread"
        self._costs = costs
        self._threads = loader_threads
        self._schedule = schedule
        self._changed = changed
        self._to_read: deque[VersionRef] = deque()  # reads started, waiting for a loader thread
        self._reading = 0                           # loader threads busy
        self._stream_free_s = 0.0                   # when the copy stream has run every copy queued on it
        self._staging = False
        self._staged: list[VersionRef] = []         # reads `stage` completes at no time
        # Slots are the kernel table's rows: a simulated GPU has one for every rank-1 adapter its bytes hold,
        # so bytes alone bound it.
        limits = ResidencyLimits(max(1, gpu_bytes // costs.adapter_bytes(1)), gpu_bytes, host_bytes,
                                 lambda ref: costs.adapter_bytes(ref.rank), lambda ref: costs.adapter_bytes(ref.rank))
        self.residency = Residency(limits, self, eviction, failure_ttl_s=0.0, failure_max_ttl_s=0.0, clock=clock)
        self._clock = clock

    def ready(self, adapter: SimAdapter) -> bool:
        return self.residency.status(adapter).usable

    def stage(self, adapter: SimAdapter) -> bool:
        """Initial placement, before the trace starts: `adapter` read into free host memory at no time, as a
        placement's host preload leaves it; whether it is there."""
        tiers = self.residency.tiers
        nbytes = self._costs.adapter_bytes(adapter.rank)
        if tiers.size(adapter.sha256) == 0 and nbytes > tiers.host_bytes - tiers.host_used:
            return False
        self._staging = True
        try:
            self.residency.preload_host(adapter)  # its read starts: `start_read` holds it back
        finally:
            self._staging = False
        for ref in self._staged:
            self.residency.read_done(ref.sha256, nbytes, nbytes, ref.rank)
        self._staged.clear()
        self.residency.advance()
        return True

    # --- the residency's port ---

    def start_read(self, ref: VersionRef) -> None:
        if self._staging:  # before the trace: done at once, reported by `stage`
            self._staged.append(ref)
            return
        self._to_read.append(ref)
        self._start_reads(self._clock())

    def start_copy(self, ref: VersionRef, slot: int) -> bool:
        now = self._clock()
        self._stream_free_s = max(now, self._stream_free_s) + self._costs.host_to_gpu_s(ref.rank)
        self._schedule(self._stream_free_s, lambda t, digest=ref.sha256: self._copied(digest, t))
        return False

    def release_slot(self, slot: int) -> None:
        """Nothing to free: the simulated GPU holds no bytes."""

    def release_host(self, digest: str) -> None:
        """Nothing to free: the simulated host tier holds no bytes."""

    def observe_load(self, source: str, seconds: float) -> None:
        """Not recorded: the simulator reports requests' times, not loads'."""

    def load_failed(self, ref: VersionRef, names: list[str], failure: Failure, error: BaseException) -> None:
        raise AssertionError(f"a simulated load cannot fail: {ref.name}: {error}")

    # --- the simulated I/O ---

    def _start_reads(self, now: float) -> None:
        while self._to_read and self._reading < self._threads:
            ref = self._to_read.popleft()
            self._reading += 1
            self._schedule(now + self._costs.disk_to_host_s(ref.rank), lambda t, r=ref: self._read(r, t))

    def _read(self, ref: VersionRef, now: float) -> None:
        self._reading -= 1
        nbytes = self._costs.adapter_bytes(ref.rank)
        self.residency.read_done(ref.sha256, nbytes, nbytes, ref.rank)
        self._start_reads(now)
        self.residency.advance()
        self._changed(now)

    def _copied(self, digest: str, now: float) -> None:
        self.residency.copy_done(digest)
        self.residency.advance()
        self._changed(now)
