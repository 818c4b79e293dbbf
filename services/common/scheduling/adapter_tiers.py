"""One worker's adapter tiers: GPU slots, pinned host memory, disk — and which adapter leaves when
(an `Eviction` policy, services/common/scheduling/eviction.py). The host tier is inclusive:
an adapter on the GPU also has its host copy, so evicting it from the GPU costs no copy back.
Adapters in use (pinned) are never evicted. Timing (how long a load takes) is the caller's:
`LoadCosts` prices it, the worker (or the simulator's worker) schedules it.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from services.common.scheduling.eviction import Eviction, Record


class Tier(enum.IntEnum):
    GPU = 0
    HOST = 1
    DISK = 2


@dataclass(frozen=True)
class LoadCosts:
    """Seconds to make an adapter GPU-resident from a tier: a fixed cost plus its bytes over a rate."""

    bytes_per_rank: int = 2 * 1024**2  # q,k,v,o of a Llama-2-7B in bf16: 4 proj · (A+B = 2·4096·r) · 2 B · 32 layers
    host_fixed_s: float = 0.5e-3       # pinned host -> GPU copy launch and slot bookkeeping
    host_bytes_per_s: float = 25e9     # PCIe Gen5 x16, pinned memory
    disk_fixed_s: float = 20e-3        # open, safetensors header, registry lookup
    disk_bytes_per_s: float = 1.5e9    # NVMe read, then the sha256 check, then the copy, one after another

    def adapter_bytes(self, rank: int) -> int:
        return self.bytes_per_rank * rank

    def load_s(self, tier: Tier, rank: int) -> float:
        if tier is Tier.GPU:
            return 0.0
        if tier is Tier.HOST:
            return self.host_fixed_s + self.adapter_bytes(rank) / self.host_bytes_per_s
        return self.disk_fixed_s + self.adapter_bytes(rank) / self.disk_bytes_per_s


class AdapterCache:
    """GPU slots and host slots of one worker, counted in adapters."""

    def __init__(self, gpu_slots: int, host_slots: int, eviction: Eviction) -> None:
        if gpu_slots < 1 or host_slots < gpu_slots:
            raise ValueError(f"need 1 <= gpu_slots <= host_slots (inclusive host tier), got {gpu_slots}, {host_slots}")
        self.gpu_slots = gpu_slots
        self.host_slots = host_slots
        self._eviction = eviction
        self._records: dict[str, Record] = {}
        self._gpu: dict[str, int] = {}  # adapter -> rank
        self._host: dict[str, None] = {}  # includes every GPU adapter; a dict for a seed-proof order
        self._pins: dict[str, int] = {}
        self.evictions = 0              # GPU evictions so far

    def tier(self, adapter: str) -> Tier:
        if adapter in self._gpu:
            return Tier.GPU
        return Tier.HOST if adapter in self._host else Tier.DISK

    def touch(self, adapter: str, now: float) -> None:
        """Record an access (a request for `adapter` reached this worker)."""
        self._records[adapter] = self._eviction.touched(self._records.get(adapter), now)

    def pin(self, adapter: str) -> None:
        self._pins[adapter] = self._pins.get(adapter, 0) + 1

    def unpin(self, adapter: str) -> None:
        pins = self._pins.get(adapter, 0) - 1
        assert pins >= 0, f"{adapter} unpinned more often than pinned"
        if pins:
            self._pins[adapter] = pins
        else:
            del self._pins[adapter]

    def stage_in_host(self, adapter: str) -> bool:
        """Placement without a request (e.g. the registry's initial placement): copy `adapter` into
        host memory if a slot is free; returns whether it is there now. Never evicts."""
        if adapter not in self._host and len(self._host) < self.host_slots:
            self._host[adapter] = None
        return adapter in self._host

    def admit_to_gpu(self, adapter: str, rank: int) -> Tier | None:
        """Give `adapter` a GPU slot (its load starts now); returns the tier it loads from, or None when
        every slot holds a pinned adapter (try again after an unpin)."""
        source = self.tier(adapter)
        assert source is not Tier.GPU, f"{adapter} is already on the GPU"
        if len(self._gpu) >= self.gpu_slots:
            victim = self._coldest(a for a in self._gpu if a not in self._pins)
            if victim is None:
                return None
            del self._gpu[victim]  # its host copy stays
            self.evictions += 1
        if source is Tier.DISK:
            if len(self._host) >= self.host_slots:
                victim = self._coldest(a for a in self._host if a not in self._gpu)
                assert victim is not None, "host tier smaller than the GPU tier"
                del self._host[victim]
            self._host[adapter] = None
        self._gpu[adapter] = rank
        return source

    @property
    def gpu_adapters(self) -> frozenset[str]:
        return frozenset(self._gpu)

    @property
    def host_adapters(self) -> frozenset[str]:
        return frozenset(self._host)

    def gpu_ranks(self) -> int:
        """Σ ranks of the GPU-resident adapters (bytes = this × LoadCosts.bytes_per_rank)."""
        return sum(self._gpu.values())

    def _coldest(self, adapters) -> str | None:
        # Staged but never requested adapters go first.
        return min(adapters, key=lambda a: self._eviction.keep(self._records[a]) if a in self._records
                   else -math.inf, default=None)
