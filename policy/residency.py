"""One worker's adapter residency: which version of which adapter is in GPU memory, in host memory or on
disk only, which load starts next, and what a request finds. A state machine on a clock, with no I/O of
its own: the real worker (gpu_worker/lora/adapter_manager.py) drives it with loader threads and a CUDA
side stream, the cluster simulator (policy/simulator/loads.py) with its event schedule.

Adapters are held by version, keyed by their content digest: a name registered again with other weights
is another version. In-flight requests keep the version they arrived with, new ones get the newest; an old
version leaves every tier once its last request ends.

A request's adapter, step by step:
  arrive(ref)   pin its version in the tiers (adapter_tiers.py: byte budgets, eviction by the
                `Eviction` policy) until the request ends, and start the load it needs: disk -> host
                (`LoadPort.start_read`), then host -> GPU (`LoadPort.start_copy`) into a free slot.
  read_done, read_failed, copy_done
                the driver tells of each completion, then calls `advance`, which starts the loads that
                have room now (in arrival order of the versions waiting).
  status(ref)   what a request finds: its slot and rank once placed, whether usable, what the copy has
                left, or why its load failed. A failure is remembered with a backoff (load_failures.py),
                so requests for a broken version fail without reading its files again.
  depart(ref)   the request ended, waiting or running: unpin.

The registry's orders (placement_orders.py): `preload` loads a version into host and GPU memory without a
request (a placement plan's weighed by the rate it expects, and declined where it would displace hotter
adapters), `preload_host` reads one into host memory only, `pin` / `unpin` hold one on the GPU, never
evicted, and `retire` tells that the registry no longer serves a version under a name.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from policy.adapter_tiers import AdapterTiers, Tier
from policy.eviction import Eviction
from policy.load_failures import RecentFailures
from policy.residency_edge import AdapterPlacement, LoadPort, Residence, ResidencyLimits, VersionRef
from services.common.errors import FailedPrecondition

# Operators' pins hold at most this share of the GPU's adapter slots and bytes (each pin counted at the
# most its rank can take): the rest stays for the adapters that requests bring, which would otherwise
# wait for room forever.
MAX_PINNED_SHARE = 0.5
COPY_RATE_EWMA = 0.2  # weight of the newest install in the host -> GPU rate estimate


@dataclass
class _Version:
    ref: VersionRef                          # as it first arrived: its storage is the one read
    names: set[str] = field(default_factory=set)  # names it arrived under
    requests: int = 0                        # live requests (each holds a pin in the tiers)
    in_host: bool = False                    # its host copy is read
    rank: int = 0                            # its weights' rank, once read
    gpu_nbytes: int = 0                      # what it takes on the GPU, once read
    reading: bool = False
    slot: int | None = None                  # its GPU slot from placement on (the copy may still run)
    copying: bool = False                    # the copy onto the GPU, until it has completed
    started: float = 0.0                     # when the read or copy in progress started
    pinned: bool = False                     # by an operator's order: made usable, then never evicted
    preloading: bool = False                 # an operator's preload: held (pinned) until usable
    host_preloading: bool = False            # a placement's host-only preload: held (pinned) until read

    @property
    def usable(self) -> bool:
        return self.slot is not None and not self.copying

    @property
    def wanted(self) -> bool:
        """Something waits for it on the GPU: requests, or an operator's pin or preload."""
        return bool(self.requests) or self.pinned or self.preloading


class Residency:
    def __init__(self, limits: ResidencyLimits, port: LoadPort, eviction: Eviction, *, failure_ttl_s: float,
                 failure_max_ttl_s: float, clock: Callable[[], float], copy_bytes_per_s: float = 0.0) -> None:
        """`failure_ttl_s`: a failed load is not tried again for this long, doubled at each failure in a row up
        to `failure_max_ttl_s`. `copy_bytes_per_s`: the host -> GPU rate measured at start (0: none yet)."""
        self._limits = limits
        self._port = port
        self.tiers = AdapterTiers(limits.gpu_bytes, limits.host_bytes, eviction, gpu_max_adapters=limits.gpu_slots)
        self._free_slots = list(range(limits.gpu_slots - 1, -1, -1))  # pop() hands out low slots first
        self._versions: dict[str, _Version] = {}  # digest -> every version in a tier, being read, or requested
        self._active: dict[str, None] = {}        # versions with a load in flight or waited for, oldest first
        self._newest: dict[str, str] = {}         # adapter name -> digest of the last version that arrived
        self._failures = RecentFailures(failure_ttl_s, failure_max_ttl_s, clock)
        self._clock = clock
        self._copy_bytes_per_s = copy_bytes_per_s
        self.hits = self.misses = 0

    # --- a request's adapter ---

    def arrive(self, ref: VersionRef) -> bool:
        """A request for `ref` arrived; whether its version was usable (a hit)."""
        version = self._version_of(ref)
        version.requests += 1
        self.tiers.pin(ref.sha256)
        self.tiers.touch(ref.sha256, self._clock())
        hit = version.usable
        if hit:
            self.hits += 1
        else:
            self.misses += 1
        self._want(ref.sha256, version)
        return hit

    def status(self, ref: VersionRef) -> Residence:
        version = self._versions.get(ref.sha256)
        failure = self._failure_cause(ref)
        if version is None:
            return Residence(failure, None, 0, False, False, None)
        return Residence(failure, version.slot, version.rank, version.usable, version.in_host,
                         self._copy_left_s(version))

    def depart(self, ref: VersionRef) -> None:
        key = ref.sha256
        version = self._versions[key]
        assert version.requests > 0, ref
        version.requests -= 1
        self.tiers.unpin(key)
        self._drop_if_unused(key)

    # --- the driver's reports ---

    def read_done(self, digest: str, host_nbytes: int, gpu_nbytes: int, rank: int) -> bool:
        """`digest`'s read completed; whether its host copy is kept (False: the version was forgotten while
        it was read, or its weights are not what the registry recorded)."""
        version = self._versions.get(digest)
        if version is None or not version.reading:
            return False
        version.reading = False
        if host_nbytes > self.tiers.size(digest):
            self._fail(digest, version, FailedPrecondition(
                f"its weights have rank {rank}, the registry recorded rank {version.ref.rank}"))
            return False
        version.in_host, version.rank, version.gpu_nbytes = True, rank, gpu_nbytes
        self._failures.succeeded(digest)
        self.tiers.resize(digest, host_nbytes, gpu_nbytes=gpu_nbytes)
        self._port.observe_load("disk", self._clock() - version.started)
        return True

    def read_failed(self, digest: str, error: BaseException) -> None:
        version = self._versions.get(digest)
        if version is not None and version.reading:
            version.reading = False
            self._fail(digest, version, error)

    def copy_done(self, digest: str) -> None:
        version = self._versions.get(digest)
        if version is not None and version.copying:
            version.copying = False
            self._copied(version)

    def advance(self) -> None:
        """Start the loads that have room now, and let go of the preloads that are done."""
        for key in list(self._active):
            if key not in self._active:
                continue  # evicted to make room for a version before it
            version = self._versions[key]
            if not version.usable and (version.wanted or (version.host_preloading and not version.in_host)):
                self._advance(key, version)
            self._end_preload(key, version)
            if key in self._active and not version.reading and not version.copying and (
                    version.usable or not (version.wanted or version.host_preloading)):
                del self._active[key]

    # --- the registry's orders: an operator's, or the placement plan's (placement_orders.py) ---

    def preload(self, ref: VersionRef, rate: float = 0.0) -> bool:
        """Load `ref` into host and GPU memory without a request. An operator's (`rate` 0) records no
        access, so it is the first to leave when room is needed. A placement plan's (`rate`: the requests/s
        it expects here) is recorded as an adapter requested that often, and is declined (False) where it
        would displace an adapter its rate does not beat. A no-op if it is usable or on its way; refused
        (False) while a failure of its load is remembered. A plan's preload is background work: declined
        too while another load is in flight or waited for (`_may_place`)."""
        if self._failure_cause(ref) is not None:
            return False
        version = self._version_of(ref)
        if rate > 0:
            self.tiers.expect(ref.sha256, rate, self._clock())
        if version.usable or version.preloading:
            return True
        if rate > 0 and not self._may_place(ref, Tier.GPU):
            self._drop_if_unused(ref.sha256)
            return False
        version.preloading = True
        self.tiers.pin(ref.sha256)  # until usable: no other load evicts it halfway
        self._want(ref.sha256, version)
        self._end_preload(ref.sha256, version)
        return True

    def preload_host(self, ref: VersionRef, rate: float = 0.0) -> bool:
        """Read `ref` into host memory without a request, no further (the registry's placement of a warm
        adapter: a later request for it starts from host memory). `rate` as for `preload`. A no-op where it
        is in host memory or on its way; refused (False) while a failure of its load is remembered."""
        if self._failure_cause(ref) is not None:
            return False
        version = self._version_of(ref)
        if rate > 0:
            self.tiers.expect(ref.sha256, rate, self._clock())
        if version.in_host or version.reading or version.host_preloading:
            return True
        if rate > 0 and not self._may_place(ref, Tier.HOST):
            self._drop_if_unused(ref.sha256)
            return False
        version.host_preloading = True
        self.tiers.pin(ref.sha256)  # until read: no other load evicts it halfway
        self._active[ref.sha256] = None
        self._advance(ref.sha256, version)
        return True

    def pin(self, ref: VersionRef) -> bool:
        """Load `ref` onto the GPU and keep it there, never evicted, until `unpin`; whether it is pinned.
        Refused if its load failed lately (a failed load lifts the pin: see `_fail`), or if operators'
        pins would hold more than MAX_PINNED_SHARE of the GPU's adapter slots or bytes with it."""
        if (version := self._versions.get(ref.sha256)) is not None and version.pinned:
            self._version_of(ref)  # under this name too
            return True
        pinned = [v.ref for v in self._versions.values() if v.pinned] + [ref]
        limits = self._limits
        if self._failure_cause(ref) is not None or len(pinned) > MAX_PINNED_SHARE * limits.gpu_slots or (
                sum(map(limits.gpu_bytes_of, pinned)) > MAX_PINNED_SHARE * limits.gpu_bytes):
            return False
        version = self._version_of(ref)
        version.pinned = True
        self.tiers.pin(ref.sha256)
        self._want(ref.sha256, version)
        return True

    def unpin(self, digest: str) -> None:
        """Lift an operator's pin: the version stays where it is, evictable like any other."""
        version = self._versions.get(digest)
        if version is not None and version.pinned:
            version.pinned = False
            self.tiers.unpin(digest)
            self._drop_if_unused(digest)

    @property
    def operator_pins(self) -> frozenset[str]:
        """Digests pinned by an operator's order."""
        return frozenset(key for key, version in self._versions.items() if version.pinned)

    def retire(self, name: str, digest: str) -> None:
        """The registry no longer serves `digest` under `name` (the adapter was deleted, or registered again
        with other weights): the version stops answering to `name`. Once no name is left it loses any
        operator pin or preload and leaves every tier as its last request ends; requests in flight finish."""
        if self._newest.get(name) == digest:
            del self._newest[name]
        version = self._versions.get(digest)
        if version is None:
            return
        version.names.discard(name)
        if not version.names:
            self._release_orders(digest, version)
        self._drop_if_unused(digest)

    # --- what it holds ---

    def placements(self) -> tuple[AdapterPlacement, ...]:
        """Every (name, version) held, by name then digest."""
        return tuple(sorted((AdapterPlacement(
            name, key, Tier.GPU if version.usable else Tier.HOST if version.in_host else Tier.DISK,
            loading=version.reading or version.copying or (
                version.wanted and not version.usable and self._failures.cause(key) is None),
            pinned=version.pinned, newest=self._newest.get(name) == key)
            for key, version in self._versions.items() for name in version.names), key=lambda p: (p.name, p.sha256)))

    @property
    def requests(self) -> int:
        """Pins held by live requests."""
        return sum(v.requests for v in self._versions.values())

    @property
    def load_failures(self) -> int:
        return self._failures.count

    @property
    def failing(self) -> bool:
        """Whether some version's failed load may still be in its backoff: if not, no request is failed."""
        return bool(self._failures)

    # --- loads ---

    def _failure_cause(self, ref: VersionRef) -> str | None:
        """Why `ref`'s version last failed to load, while its backoff lasts; a registration newer than the one
        that failed (the operator registered it again, its stored copy replaced) is tried at once."""
        if not self._failures:  # the usual case, and the cheap one: no backoff runs
            return None
        self._failures.renewed(ref.sha256, ref.registered_ms)
        return self._failures.cause(ref.sha256)

    def _copy_left_s(self, version: _Version) -> float | None:
        """About how long `version`'s copy onto the GPU still runs, at the rate installs have measured; None
        while it has no GPU placement (its bytes are not read yet, or every GPU byte is held)."""
        if version.slot is None:
            return None
        if not version.copying:
            return 0.0
        if not self._copy_bytes_per_s:
            return math.inf  # not measured: no estimate to stake other requests' steps on
        return max(0.0, version.gpu_nbytes / self._copy_bytes_per_s - (self._clock() - version.started))

    def _version_of(self, ref: VersionRef) -> _Version:
        """`ref`'s version, now the newest under its name (the version it replaces goes if nothing holds it)."""
        key = ref.sha256
        assert key, f"adapter {ref.name} has no digest: versions are keyed by it"
        version = self._versions.setdefault(key, _Version(ref))
        version.names.add(ref.name)
        replaced, self._newest[ref.name] = self._newest.get(ref.name), key
        if replaced is not None and replaced != key:
            self._drop_if_unused(replaced)
        return version

    def _may_place(self, ref: VersionRef, tier: Tier) -> bool:
        """Whether a placement plan's preload of `ref` into `tier` starts now: it is background work, so only
        while no other load is in flight or waited for (one at a time, never ahead of a request's), and only
        displacing adapters colder than its record."""
        if self._active:
            return False
        key = ref.sha256
        in_host = self.tiers.tier(key) is not Tier.DISK
        if not in_host and not self.tiers.room_for(key, Tier.HOST, self._limits.host_bytes_of(ref)):
            return False
        return tier is Tier.HOST or self.tiers.room_for(
            key, Tier.GPU, self.tiers.gpu_size(key) if in_host else self._limits.gpu_bytes_of(ref))

    def _too_big(self, ref: VersionRef) -> str | None:
        """Why `ref` can never be loaded: it takes more than a whole tier (a task head or tower LoRA can make
        an adapter larger than one of the largest rank the worker was sized for); None when it fits."""
        limits = self._limits
        for tier, needed, budget, setting in (("GPU", limits.gpu_bytes_of(ref), limits.gpu_bytes, "adapter_gpu_bytes"),
                                              ("host", limits.host_bytes_of(ref), limits.host_bytes,
                                               "adapter_host_bytes")):
            if needed > budget:
                return (f"it takes {needed} bytes, more than this worker's whole {tier} adapter tier ({budget} bytes, "
                        f"worker.{setting}); give the worker a larger tier")
        return None

    def _want(self, key: str, version: _Version) -> None:
        """Something now waits for `version` on the GPU: start its next load."""
        if not version.usable:
            self._active[key] = None
        self._advance(key, version)

    def _end_preload(self, key: str, version: _Version) -> None:
        """A preload holds its version only until usable (a host-only one until read): from then on it is
        an adapter like any other."""
        if version.preloading and version.usable:
            version.preloading = False
            self.tiers.unpin(key)
        if version.host_preloading and version.in_host:
            version.host_preloading = False
            self.tiers.unpin(key)

    def _release_orders(self, key: str, version: _Version) -> None:
        """Let go of an operator's pin and preload on `version` (its load failed, or its name was retired)."""
        for order in ("pinned", "preloading", "host_preloading"):
            if getattr(version, order):
                setattr(version, order, False)
                self.tiers.unpin(key)

    def _advance(self, key: str, version: _Version) -> None:
        """Start the next load `version` needs, if there is room for it; fail it if no room ever holds it."""
        if version.reading or version.copying or version.usable or self._failures.cause(key):
            return
        if (too_big := self._too_big(version.ref)) is not None:
            self._fail(key, version, FailedPrecondition(too_big))
            return
        if not version.in_host:
            if self.tiers.tier(key) is Tier.DISK:
                evicted = self.tiers.place_in_host(key, self._limits.host_bytes_of(version.ref))
                if evicted is None:
                    return  # host memory is all pinned: a later pass tries again
                for victim in evicted:  # gone from both tiers
                    self._forget(victim)
            version.started = self._clock()
            version.reading = True
            self._port.start_read(version.ref)
            return
        evicted = self.tiers.place_on_gpu(key)
        if evicted is None:
            return  # every GPU byte is pinned: a later pass tries again
        for victim in evicted:  # their host copies stay
            self._free_slot(self._versions[victim])
        slot = self._free_slots.pop()
        version.started = self._clock()
        try:
            done = self._port.start_copy(version.ref, slot)
        except Exception as exc:  # noqa: BLE001 - any failure fails only this version's requests
            self._free_slots.append(slot)
            self._fail(key, version, exc)
            return
        version.slot, version.copying = slot, not done
        if done:
            self._copied(version)

    def _copied(self, version: _Version) -> None:
        """`version`'s copy onto the GPU has completed: count its time, and its rate for `_copy_left_s`."""
        seconds = self._clock() - version.started
        self._port.observe_load("host", seconds)
        if seconds > 0:
            rate = version.gpu_nbytes / seconds
            self._copy_bytes_per_s = rate if not self._copy_bytes_per_s else (
                (1 - COPY_RATE_EWMA) * self._copy_bytes_per_s + COPY_RATE_EWMA * rate)

    def _fail(self, key: str, version: _Version, error: BaseException) -> None:
        """Remember the failure (requests for `key` fail until its backoff ends) and let go of what the load
        held."""
        failure = self._failures.remember(key, error, version.ref.registered_ms)
        self._port.load_failed(version.ref, sorted(version.names), failure, error)
        if version.in_host:
            version.in_host = False
            self._port.release_host(key)
        if version.slot is not None:
            self._free_slot(version)
        # A pin is ordered again by the registry's next answer, and retried once the failure expires.
        self._release_orders(key, version)
        self._drop_if_unused(key)

    # --- leaving ---

    def _drop_if_unused(self, key: str) -> None:
        """A version no request uses leaves every tier if a newer version of each of its names arrived,
        or if its load failed; one that is on disk only is forgotten (its access record stays in the tiers)."""
        version = self._versions.get(key)
        if version is None or version.wanted:
            return
        if self._failures.cause(key) is not None or all(self._newest.get(name) != key for name in version.names):
            self.tiers.drop(key)
            self._forget(key)
        elif self.tiers.tier(key) is Tier.DISK:
            self._forget(key)

    def _forget(self, key: str) -> None:
        """`key` left the host tier (and so the GPU): free its slot and host copy, drop its record."""
        version = self._versions.pop(key)
        if version.slot is not None:
            self._free_slot(version)
        if version.in_host:
            self._port.release_host(key)
        self._active.pop(key, None)

    def _free_slot(self, version: _Version) -> None:
        self._port.release_slot(version.slot)
        self._free_slots.append(version.slot)
        version.slot, version.copying = None, False
