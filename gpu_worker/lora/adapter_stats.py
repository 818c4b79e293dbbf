"""What the adapter manager counts, as one immutable snapshot (engine stats, /metrics, pushed state)."""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from policy.residency_edge import AdapterPlacement

# Seconds: a host -> GPU copy takes about a millisecond, a cold read from a slow disk seconds.
LOAD_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
SOURCES = ("disk", "host")  # disk: read, verify, parse, copy into host memory; host: copy onto the GPU


@dataclass(frozen=True)
class LoadTimes:
    """A latency histogram of loads from one source tier: counts[i] loads took <= LOAD_BUCKETS[i]
    (not cumulative), counts[-1] longer ones."""
    source: str
    counts: tuple[int, ...]
    sum_s: float

    @property
    def count(self) -> int:
        return sum(self.counts)


class LoadClock:
    """LoadTimes as they accumulate, one per source (engine thread)."""

    def __init__(self) -> None:
        self._counts = {source: [0] * (len(LOAD_BUCKETS) + 1) for source in SOURCES}
        self._sums = dict.fromkeys(SOURCES, 0.0)

    def observe(self, source: str, seconds: float) -> None:
        self._counts[source][bisect.bisect_left(LOAD_BUCKETS, seconds)] += 1
        self._sums[source] += seconds

    def snapshot(self) -> tuple[LoadTimes, ...]:
        return tuple(LoadTimes(s, tuple(self._counts[s]), self._sums[s]) for s in SOURCES)


@dataclass(frozen=True)
class AdapterTierStats:
    # By adapter name, for the gateway: where a new request for that name would find its adapter
    # (the newest version that reached this worker).
    gpu_adapters: tuple[str, ...] = ()      # usable on the GPU now
    host_adapters: tuple[str, ...] = ()     # in host memory (the GPU ones included: the tier is inclusive)
    loading_adapters: tuple[str, ...] = ()  # on their way: disk -> host, or host -> GPU
    gpu_victim_rate: float = 0.0            # requests/s of what one more GPU load would evict (AdapterTiers)
    # By version (every adapter version held, old ones that in-flight requests still use included).
    gpu_versions: int = 0
    host_versions: int = 0
    gpu_bytes: int = 0                      # as budgeted: an adapter counts what it occupies on the GPU
    host_bytes: int = 0
    gpu_capacity_bytes: int = 0
    host_capacity_bytes: int = 0
    pinned: int = 0                         # pins held by live requests, one each, from arrival to end
    hits: int = 0                           # requests whose adapter was usable on the GPU at arrival
    misses: int = 0
    gpu_evictions: int = 0
    gpu_compactions: int = 0                # installs that first closed the GPU arena's holes (moves on the device)
    host_evictions: int = 0                 # left host memory (and the GPU, if there too) for disk
    load_failures: int = 0                  # loads that failed (not the requests they failed)
    loads: tuple[LoadTimes, ...] = ()
    placements: tuple[AdapterPlacement, ...] = ()  # every (name, version) held, by name then digest
