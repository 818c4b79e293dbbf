"""One worker's adapter tiers: GPU memory, pinned host memory, disk — and which adapter leaves when
(an `Eviction` policy, policy/eviction.py). The real worker
(gpu_worker/lora/adapter_manager.py) and the cluster simulator's worker keep their tiers with the
same class. Timing (how long a load takes) is the caller's: `LoadCosts` prices it, the worker (or the
simulator's worker) schedules it.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass

from policy.eviction import Eviction, Record


class Tier(enum.IntEnum):
    GPU = 0
    HOST = 1
    DISK = 2


@dataclass(frozen=True)
class LoadCosts:
    """Seconds to make an adapter GPU-resident from a tier, in the worker's two stages: disk -> host
    (a loader thread) then host -> GPU (the copy stream); each a fixed cost plus its bytes over a rate."""

    bytes_per_rank: int = 2 * 1024**2  # q,k,v,o of a Llama-2-7B in bf16: 4 proj · (A+B = 2·4096·r) · 2 B · 32 layers
    host_fixed_s: float = 0.5e-3       # pinned host -> GPU copy launch and bookkeeping
    host_bytes_per_s: float = 25e9     # PCIe Gen5 x16, pinned memory
    disk_fixed_s: float = 20e-3        # open, safetensors header, registry lookup
    disk_bytes_per_s: float = 1.5e9    # NVMe read, then the sha256 check and parse into pinned memory

    def adapter_bytes(self, rank: int) -> int:
        return self.bytes_per_rank * rank

    def disk_to_host_s(self, rank: int) -> float:
        return self.disk_fixed_s + self.adapter_bytes(rank) / self.disk_bytes_per_s

    def host_to_gpu_s(self, rank: int) -> float:
        return self.host_fixed_s + self.adapter_bytes(rank) / self.host_bytes_per_s

    def load_s(self, tier: Tier, rank: int) -> float:
        if tier is Tier.GPU:
            return 0.0
        if tier is Tier.HOST:
            return self.host_to_gpu_s(rank)
        return self.disk_to_host_s(rank) + self.host_to_gpu_s(rank)


class AdapterTiers:
    """One worker's GPU and host tiers, budgeted in bytes (the real worker's and the simulated one's).

    Bookkeeping only: which adapter sits in which tier, what each occupies, what is pinned and which
    adapter leaves when room is needed. Bytes are reserved when a load starts, so a load in flight
    counts. The host tier is inclusive (a GPU adapter keeps its host copy), so `host_bytes` must be
    at least `gpu_bytes`. Pinned adapters (a request holds them from arrival to its end, or an
    operator pinned them) are never evicted from either tier. `place_*` return the adapters evicted
    to make room, or None when nothing evictable frees enough (the caller retries after an unpin).
    """

    def __init__(self, gpu_bytes: int, host_bytes: int, eviction: Eviction, gpu_max_adapters: int | None = None) -> None:
        """`gpu_max_adapters`: how many adapters the GPU holds at once at most, whatever their bytes
        (the worker's kernel tables have that many rows); None: bytes alone bound it."""
        if gpu_bytes < 1 or host_bytes < gpu_bytes:
            raise ValueError(f"need 1 <= GPU bytes <= host bytes (the host tier holds every GPU adapter's "
                             f"copy), got {gpu_bytes} and {host_bytes}")
        if gpu_max_adapters is not None and gpu_max_adapters < 1:
            raise ValueError(f"the GPU tier must hold at least one adapter, got {gpu_max_adapters}")
        self.gpu_bytes = gpu_bytes
        self.host_bytes = host_bytes
        self.gpu_max_adapters = gpu_max_adapters
        self._eviction = eviction
        self._records: dict[str, Record] = {}
        self._host: dict[str, int] = {}  # adapter -> bytes in host memory; every GPU adapter too
        self._gpu_size: dict[str, int] = {}  # adapter -> bytes on the GPU, where they differ from the host's
        self._gpu: dict[str, None] = {}  # a dict, not a set: an order that no hash seed changes
        self._pins: dict[str, int] = {}
        self.evictions = {Tier.GPU: 0, Tier.HOST: 0}

    def tier(self, adapter: str) -> Tier:
        if adapter in self._gpu:
            return Tier.GPU
        return Tier.HOST if adapter in self._host else Tier.DISK

    def size(self, adapter: str) -> int:
        """Bytes `adapter` occupies in host memory (0 if on disk only)."""
        return self._host.get(adapter, 0)

    def gpu_size(self, adapter: str) -> int:
        """Bytes `adapter` occupies (or would) on the GPU."""
        return self._gpu_size.get(adapter, self._host.get(adapter, 0))

    def touch(self, adapter: str, now: float) -> None:
        """Record an access (a request for `adapter` reached this worker)."""
        self._records[adapter] = self._eviction.touched(self._records.get(adapter), now)

    def expect(self, adapter: str, rate: float, now: float) -> None:
        """A placement plan expects `adapter` at `rate` requests/s here: its record becomes that of a steady
        `rate` (kept where its own accesses already say more), so it is evicted as an adapter that popular
        would be, not first as an unused preload."""
        planned = self._eviction.expected(rate, now)
        record = self._records.get(adapter)
        if record is None or self._eviction.keep(planned) > self._eviction.keep(record):
            self._records[adapter] = planned

    def room_for(self, adapter: str, tier: Tier, nbytes: int) -> bool:
        """Whether `adapter` (`nbytes` there) could enter `tier` now displacing only colder adapters than
        it, none that its record does not beat (a placement's preload must not evict what requests keep hot)."""
        assert tier is not Tier.DISK
        keep = self._keep(adapter)
        colder = [a for a in (self._gpu if tier is Tier.GPU else self._host)
                  if a not in self._pins and a != adapter and self._keep(a) < keep]
        if tier is Tier.HOST:
            return self._make_room(self.host_bytes - self.host_used, nbytes, colder) is not None
        seats_short = 0 if self.gpu_max_adapters is None else max(0, len(self._gpu) + 1 - self.gpu_max_adapters)
        return self._make_room(self.gpu_bytes - self.gpu_used, nbytes, colder, self.gpu_size, seats_short) is not None

    def gpu_victim_rate(self, now: float) -> float:
        """The requests/s expected here of the adapter that the next GPU placement would evict first: what
        placing one more adapter on this GPU costs the others (the router weighs it, policy/routing/
        tessera_policy.py). 0 while the tier has a free seat and the bytes of the biggest adapter it holds,
        or holds nothing it could evict."""
        biggest = max((self.gpu_size(a) for a in self._gpu), default=0)
        seat_free = self.gpu_max_adapters is None or len(self._gpu) < self.gpu_max_adapters
        unpinned = [a for a in self._gpu if a not in self._pins]
        if (seat_free and self.gpu_bytes - self.gpu_used >= biggest) or not unpinned:
            return 0.0
        record = self._records.get(min(unpinned, key=self._keep))
        return 0.0 if record is None else self._eviction.rate(record, now)

    def pin(self, adapter: str) -> None:
        self._pins[adapter] = self._pins.get(adapter, 0) + 1

    def unpin(self, adapter: str) -> None:
        pins = self._pins.get(adapter, 0) - 1
        assert pins >= 0, f"{adapter} unpinned more often than pinned"
        if pins:
            self._pins[adapter] = pins
        else:
            del self._pins[adapter]

    def pinned(self, adapter: str) -> bool:
        return adapter in self._pins

    def place_in_host(self, adapter: str, nbytes: int) -> list[str] | None:
        """Reserve `nbytes` of host memory for `adapter` (its load from disk starts now)."""
        assert adapter not in self._host, f"{adapter} is already in host memory"
        # Host-only adapters go first; an unpinned GPU adapter leaves both tiers only if they are not enough.
        candidates = sorted((a for a in self._host if a not in self._pins), key=lambda a: (a in self._gpu, self._keep(a)))
        victims = self._make_room(self.host_bytes - self.host_used, nbytes, candidates)
        if victims is None:
            return None
        for victim in victims:
            del self._host[victim]
            self._gpu_size.pop(victim, None)
            if victim in self._gpu:
                del self._gpu[victim]
                self.evictions[Tier.GPU] += 1
        self.evictions[Tier.HOST] += len(victims)
        self._host[adapter] = nbytes
        return victims

    def resize(self, adapter: str, nbytes: int, gpu_nbytes: int | None = None) -> None:
        """A host-only adapter's true size, now that its load read it (it was placed at an upper bound);
        `gpu_nbytes`: what it takes on the GPU, if not the same."""
        assert adapter in self._host and adapter not in self._gpu and nbytes <= self._host[adapter], adapter
        self._host[adapter] = nbytes
        if gpu_nbytes is not None:
            self._gpu_size[adapter] = gpu_nbytes

    def stage_in_host(self, adapter: str, nbytes: int) -> bool:
        """Placement without a request (an initial placement): `adapter` into host memory if it fits
        in what is free; returns whether it is there now. Never evicts."""
        if adapter not in self._host and nbytes <= self.host_bytes - self.host_used:
            self._host[adapter] = nbytes
        return adapter in self._host

    def place_on_gpu(self, adapter: str) -> list[str] | None:
        """Reserve GPU memory for `adapter`, which is in host memory (its copy starts now)."""
        assert adapter in self._host and adapter not in self._gpu, f"{adapter} is not host-only"
        # One more seat too when the GPU holds its most adapters: counted as bytes, each seat is a victim.
        seats_short = 0 if self.gpu_max_adapters is None else max(0, len(self._gpu) + 1 - self.gpu_max_adapters)
        victims = self._make_room(self.gpu_bytes - self.gpu_used, self.gpu_size(adapter),
                                  sorted((a for a in self._gpu if a not in self._pins), key=self._keep),
                                  self.gpu_size, seats_short)
        if victims is None:
            return None
        for victim in victims:
            del self._gpu[victim]  # its host copy stays
        self.evictions[Tier.GPU] += len(victims)
        self._gpu[adapter] = None
        return victims

    def drop(self, adapter: str) -> None:
        """Forget `adapter` in every tier (deleted, replaced by a new version, or its load failed)."""
        assert adapter not in self._pins, f"{adapter} is pinned"
        self._gpu.pop(adapter, None)
        self._gpu_size.pop(adapter, None)
        self._host.pop(adapter, None)
        self._records.pop(adapter, None)

    @property
    def gpu_adapters(self) -> frozenset[str]:
        return frozenset(self._gpu)

    @property
    def host_adapters(self) -> frozenset[str]:
        return frozenset(self._host)

    @property
    def gpu_used(self) -> int:
        return sum(self.gpu_size(a) for a in self._gpu)

    @property
    def host_used(self) -> int:
        return sum(self._host.values())

    def fits(self, nbytes: int) -> bool:
        """Whether an adapter of `nbytes` could ever be placed on the GPU (with everything else evicted)."""
        return nbytes <= self.gpu_bytes

    def _make_room(self, free: int, needed: int, candidates: list[str], size_of: Callable[[str], int] | None = None,
                   min_victims: int = 0) -> list[str] | None:
        """The first `candidates` (coldest first), at least `min_victims` of them, whose bytes, added to
        `free`, make `needed`; None if all of them do not."""
        victims: list[str] = []
        for victim in candidates:
            if free >= needed and len(victims) >= min_victims:
                break
            victims.append(victim)
            free += (size_of or self.size)(victim)
        return victims if free >= needed and len(victims) >= min_victims else None

    def _keep(self, adapter: str) -> float:
        # Placed but never requested adapters (preloads that nobody used) go first.
        record = self._records.get(adapter)
        return -math.inf if record is None else self._eviction.keep(record)
