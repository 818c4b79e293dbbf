"""The worker's adapter memory hierarchy: GPU memory, a host tier, disk — with loads beside serving.

Adapters are held by version, keyed by their content digest (AdapterRef.sha256): a name registered
again with other weights is another version. In-flight requests keep the version they arrived with,
new ones get the newest; an old version leaves every tier once its last request ends.

A request's adapter, step by step (engine thread unless said):
  arrive(ref)    the request reached the worker: pin its version in the tiers (policy/
                 adapter_tiers.py: byte budgets, eviction by frequency with decay or LRU) until it
                 ends, and start the load it needs. Disk -> host runs on a loader thread: read, verify
                 against the digest (once, here), parse, copy into one page-locked buffer
                 (host_weights.py). Host -> GPU runs on a side CUDA stream (gpu_memory.py); an event
                 marks its end. Neither stops a step.
  poll()         every scheduling pass: take finished reads into the host tier, start GPU copies for
                 the versions requests wait for, make usable those whose copy event has completed.
  resident(ref)  (slot, rank) once usable: the scheduler admits the request then, or already while
                 its copy runs (`copying_ok`, layer-pipelined loading: policy/cold_start.py decides):
                 the step's projections then wait on the device for their own bytes of
                 `pending_copy(ref)`, not the engine for the copy, so the copy overlaps the step.
  failure(ref)   the load failed: the scheduler fails the request at once (AdapterLoadFailed). The
                 failure is remembered `failure_ttl_s`, so requests for the same digest fail without
                 reading the files again.
  depart(ref)    the request ended, waiting or running: unpin.

An operator's orders, relayed by the registry (lora/placement_orders.py): `preload` loads a version
into host and GPU memory without a request (the placement plan's too, weighed by the rate it expects),
`pin` / `unpin` hold one on the GPU, never evicted, and `retire` tells that the registry no longer
serves a version under a name (DELETE drains: the version leaves every tier once its last in-flight
request ends).

A finished read or copy calls `wake` from its own thread: the engine loop, idle while every request
waits for an adapter, wakes for the next pass (set by the engine that owns the manager).
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from gpu_worker.lora.adapter_stats import AdapterPlacement, AdapterTierStats, LoadClock
from gpu_worker.lora.gpu_memory import AdapterCopy, GpuAdapterMemory
from gpu_worker.lora.host_weights import PAGE_BYTES, HostPages, PackedAdapter
from policy.load_failures import RecentFailures
from gpu_worker.lora.loader import AdapterRef, LoRAWeights
from services.common.errors import AdapterLoadFailed, FailedPrecondition, TesseraError
from policy.adapter_tiers import AdapterTiers, Tier
from policy.eviction import Eviction

log = logging.getLogger(__name__)

# Operators' pins hold at most this share of the GPU's adapter slots and bytes (each pin counted at the
# most its rank can take): the rest stays for the adapters that requests bring, which would otherwise
# wait for room forever.
MAX_PINNED_SHARE = 0.5
COPY_PROBE_BYTES = 16 << 20  # the copy that measures host -> GPU bandwidth at start


@dataclass
class _Version:
    ref: AdapterRef                          # as it first arrived: its storage path is the one read
    names: set[str] = field(default_factory=set)  # names it arrived under
    requests: int = 0                        # live requests (each holds a pin in the tiers)
    host: PackedAdapter | None = None        # the host copy, once read
    reading: concurrent.futures.Future[PackedAdapter] | None = None
    slot: int | None = None                  # its GPU slot from placement on (the copy may still run)
    copying: AdapterCopy | None = None       # the copy onto the GPU, until it has completed
    started: float = 0.0                     # when the read or copy in progress started
    pinned: bool = False                     # by an operator's order: made usable, then never evicted
    preloading: bool = False                 # an operator's preload: held (pinned) until usable
    host_preloading: bool = False            # a placement's host-only preload: held (pinned) until read

    @property
    def usable(self) -> bool:
        return self.slot is not None and self.copying is None

    @property
    def wanted(self) -> bool:
        """Something waits for it on the GPU: requests, or an operator's pin or preload."""
        return bool(self.requests) or self.pinned or self.preloading


class AdapterManager:
    def __init__(self, memory: GpuAdapterMemory, read: Callable[[AdapterRef], LoRAWeights], *, host_bytes: int,
                 loader_threads: int, eviction: Eviction, failure_ttl_s: float, failure_max_ttl_s: float = 300.0,
                 synchronous: bool = False,
                 host_page_bytes: int | None = None, host_path: Path | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`read`: an adapter from disk, verified and parsed (runs on a loader thread). `synchronous`:
        every load runs to its end on the engine thread, stalling the steps (the behaviour before the
        tiers, kept as benchmarks/cold_start_bench.py's baseline). `host_path`: hold the host tier in a
        file there, for the CPU LoRA workers to map. A failed load is not tried again for `failure_ttl_s`,
        doubled at each failure in a row up to `failure_max_ttl_s` (load_failures.py)."""
        assert loader_threads > 0 and 0 <= failure_ttl_s <= failure_max_ttl_s, (loader_threads, failure_ttl_s)
        self._memory = memory
        self._read = read
        cuda = memory.device.type == "cuda"
        # Pages of at most 1/16 of the largest adapter (a 7B's get PAGE_BYTES), so that small models' adapters
        # do not each hold a page many times their size.
        page_bytes = host_page_bytes or max(4096, min(PAGE_BYTES, memory.max_bytes // 16 // 4096 * 4096))
        # Page-locked once, here: see host_weights.py.
        self.host_pages = HostPages(host_bytes, page_locked=cuda, page_bytes=page_bytes, path=host_path)
        self._tiers = AdapterTiers(memory.budget_bytes, self.host_pages.capacity_bytes, eviction,
                                   gpu_max_adapters=memory.num_slots)
        self._loader = concurrent.futures.ThreadPoolExecutor(loader_threads, thread_name_prefix="adapter-loader")
        self._stream = torch.cuda.Stream(memory.device) if cuda else None
        # Waits for each copy's event, to wake an idle engine (the engine polls the events itself).
        self._copy_waiter = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="adapter-copy") if cuda else None
        self._free_slots = list(range(memory.num_slots - 1, -1, -1))  # pop() hands out low slots first
        self._versions: dict[str, _Version] = {}  # digest -> every version in a tier, being read, or requested
        self._active: dict[str, None] = {}        # versions with a load in flight or requests waiting, oldest first
        self._newest: dict[str, str] = {}         # adapter name -> digest of the last version that arrived
        self._failures = RecentFailures(failure_ttl_s, failure_max_ttl_s, clock)
        self._synchronous = synchronous
        self._clock = clock
        self._load_times = LoadClock()
        # Host -> GPU installs as measured: at start a copy from the host tier's memory, then each install.
        self._copy_bytes_per_s = self._measure_copy_rate() if cuda else 0.0
        self._hits = self._misses = 0
        self.wake: Callable[[], None] = lambda: None

    # --- a request's adapter ---

    def arrive(self, ref: AdapterRef) -> None:
        version = self._version_of(ref)
        version.requests += 1
        self._tiers.pin(ref.sha256)
        self._tiers.touch(ref.sha256, self._clock())
        if version.usable:
            self._hits += 1
        else:
            self._misses += 1
        self._want(ref.sha256, version)

    def resident(self, ref: AdapterRef, copying_ok: bool = False) -> tuple[int, int] | None:
        """(GPU slot, rank) of `ref`'s version once usable, or with `copying_ok` once its copy onto the
        GPU is queued (a step that runs it must first wait for `copy_event`); None while it loads."""
        version = self._versions.get(ref.sha256)
        if version is None or version.slot is None or not (version.usable or copying_ok):
            return None
        return version.slot, version.host.rank

    def pending_copy(self, ref: AdapterRef) -> AdapterCopy | None:
        """`ref`'s copy onto the GPU while it may still run; None after (or before it started)."""
        version = self._versions.get(ref.sha256)
        return None if version is None else version.copying

    def copy_left_s(self, ref: AdapterRef) -> float | None:
        """About how long `ref`'s copy onto the GPU still runs, at the rate installs have measured; None
        while it has no GPU placement (its bytes are not read yet, or every GPU byte is held)."""
        version = self._versions.get(ref.sha256)
        if version is None or version.slot is None:
            return None
        if version.copying is None:
            return 0.0
        if not self._copy_bytes_per_s:
            return math.inf  # not measured: no estimate to stake other requests' steps on
        return max(0.0, version.host.nbytes / self._copy_bytes_per_s - (self._clock() - version.started))

    def host_copy(self, ref: AdapterRef) -> PackedAdapter | None:
        """`ref`'s host copy while it is not usable on the GPU (for CPU-assisted steps); None otherwise."""
        version = self._versions.get(ref.sha256)
        return version.host if version is not None and not version.usable else None

    def failure(self, ref: AdapterRef) -> AdapterLoadFailed | None:
        """The error to fail a request for `ref` with, if its version's load failed lately."""
        cause = self._failure_cause(ref)
        return None if cause is None else AdapterLoadFailed(f"adapter {ref.name} could not be loaded: {cause}")

    def _failure_cause(self, ref: AdapterRef) -> str | None:
        """Why `ref`'s version last failed to load, while its backoff lasts; a registration newer than the one
        that failed (the operator registered it again, its stored copy replaced) is tried at once."""
        self._failures.renewed(ref.sha256, ref.registered_ms)
        return self._failures.cause(ref.sha256)

    def depart(self, ref: AdapterRef) -> None:
        key = ref.sha256
        version = self._versions[key]
        assert version.requests > 0, ref
        version.requests -= 1
        self._tiers.unpin(key)
        self._drop_if_unused(key)

    # --- the registry's orders: an operator's, or the placement plan's (lora/placement_orders.py) ---

    def preload(self, ref: AdapterRef, rate: float = 0.0) -> bool:
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
            self._tiers.expect(ref.sha256, rate, self._clock())
        if version.usable or version.preloading:
            return True
        if rate > 0 and not self._may_place(ref, Tier.GPU):
            self._drop_if_unused(ref.sha256)
            return False
        version.preloading = True
        self._tiers.pin(ref.sha256)  # until usable: no other load evicts it halfway
        self._want(ref.sha256, version)
        self._end_preload(ref.sha256, version)
        return True

    def preload_host(self, ref: AdapterRef, rate: float = 0.0) -> bool:
        """Read `ref` into host memory without a request, no further (the registry's placement of a warm
        adapter: a later request for it starts from host memory). `rate` as for `preload`. A no-op where it
        is in host memory or on its way; refused (False) while a failure of its load is remembered."""
        if self._failure_cause(ref) is not None:
            return False
        version = self._version_of(ref)
        if rate > 0:
            self._tiers.expect(ref.sha256, rate, self._clock())
        if version.host is not None or version.reading is not None or version.host_preloading:
            return True
        if rate > 0 and not self._may_place(ref, Tier.HOST):
            self._drop_if_unused(ref.sha256)
            return False
        version.host_preloading = True
        self._tiers.pin(ref.sha256)  # until read: no other load evicts it halfway
        self._active[ref.sha256] = None
        self._advance(ref.sha256, version)
        return True

    def pin(self, ref: AdapterRef) -> bool:
        """Load `ref` onto the GPU and keep it there, never evicted, until `unpin`; whether it is pinned.
        Refused if its load failed lately (a failed load lifts the pin: see `_fail`), or if operators'
        pins would hold more than MAX_PINNED_SHARE of the GPU's adapter slots or bytes with it."""
        if (version := self._versions.get(ref.sha256)) is not None and version.pinned:
            self._version_of(ref)  # under this name too
            return True
        pinned = [v.ref.rank for v in self._versions.values() if v.pinned] + [ref.rank]
        if self._failure_cause(ref) is not None or len(pinned) > MAX_PINNED_SHARE * self._memory.num_slots or (
                sum(map(self._memory.bytes_at_rank, pinned)) > MAX_PINNED_SHARE * self._memory.budget_bytes):
            return False
        version = self._version_of(ref)
        version.pinned = True
        self._tiers.pin(ref.sha256)
        self._want(ref.sha256, version)
        return True

    def unpin(self, digest: str) -> None:
        """Lift an operator's pin: the version stays where it is, evictable like any other."""
        version = self._versions.get(digest)
        if version is not None and version.pinned:
            version.pinned = False
            self._tiers.unpin(digest)
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

    def poll(self) -> None:
        """Take finished loads in and start the next ones (every scheduling pass)."""
        for key in list(self._active):
            if key not in self._active:
                continue  # evicted to make room for a version before it
            version = self._versions[key]
            if version.reading is not None and version.reading.done():
                self._read_done(key, version)
            elif version.copying is not None and version.copying.done.query():
                version.copying = None
                self._copied(version)
            if not version.usable and (version.wanted or (version.host_preloading and version.host is None)):
                self._advance(key, version)
            self._end_preload(key, version)
            if key in self._active and version.reading is None and version.copying is None and (
                    version.usable or not (version.wanted or version.host_preloading)):
                del self._active[key]

    def load_now(self, ref: AdapterRef) -> tuple[int, int]:
        """`arrive`, then wait until the version is usable: (slot, rank). For callers that run steps
        without the engine (the profiler, benchmarks); they `depart` when done. Raises AdapterLoadFailed."""
        self.arrive(ref)
        while (placed := self.resident(ref)) is None:
            if (error := self.failure(ref)) is not None:
                self.depart(ref)
                raise error
            version = self._versions[ref.sha256]
            assert version.reading or version.copying, f"no room for {ref.name}: every adapter is pinned"
            if version.reading is not None:
                concurrent.futures.wait([version.reading])
            else:
                version.copying.done.synchronize()
            self.poll()
        return placed

    def close(self) -> None:
        for pool in (self._loader, self._copy_waiter):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        self.host_pages.close()

    # --- what it holds ---

    @property
    def num_slots(self) -> int:
        return self._memory.num_slots

    def stats(self) -> AdapterTierStats:
        placements = tuple(sorted((AdapterPlacement(
            name, key, Tier.GPU if version.usable else Tier.HOST if version.host is not None else Tier.DISK,
            loading=version.reading is not None or version.copying is not None or (
                version.wanted and not version.usable and self._failures.cause(key) is None),
            pinned=version.pinned, newest=self._newest.get(name) == key)
            for key, version in self._versions.items() for name in version.names), key=lambda p: (p.name, p.sha256)))
        newest = [p for p in placements if p.newest]  # by name: where a new request finds its adapter
        tiers = self._tiers
        return AdapterTierStats(
            gpu_adapters=tuple(p.name for p in newest if p.tier is Tier.GPU),
            host_adapters=tuple(p.name for p in newest if p.tier is not Tier.DISK),
            loading_adapters=tuple(p.name for p in newest if p.loading), placements=placements,
            gpu_victim_rate=tiers.gpu_victim_rate(self._clock()),
            gpu_versions=len(tiers.gpu_adapters), host_versions=len(tiers.host_adapters),
            gpu_bytes=tiers.gpu_used, host_bytes=tiers.host_used, gpu_capacity_bytes=tiers.gpu_bytes,
            host_capacity_bytes=tiers.host_bytes, pinned=sum(v.requests for v in self._versions.values()),
            hits=self._hits, misses=self._misses, gpu_evictions=tiers.evictions[Tier.GPU],
            gpu_compactions=self._memory.compactions,
            host_evictions=tiers.evictions[Tier.HOST], load_failures=self._failures.count,
            loads=self._load_times.snapshot())

    # --- loads ---

    def _version_of(self, ref: AdapterRef) -> _Version:
        """`ref`'s version, now the newest under its name (the version it replaces goes if nothing holds it)."""
        key = ref.sha256
        assert key, f"adapter {ref.name} has no digest: versions are keyed by it"
        version = self._versions.setdefault(key, _Version(ref))
        version.names.add(ref.name)
        replaced, self._newest[ref.name] = self._newest.get(ref.name), key
        if replaced is not None and replaced != key:
            self._drop_if_unused(replaced)
        return version

    def _may_place(self, ref: AdapterRef, tier: Tier) -> bool:
        """Whether a placement plan's preload of `ref` into `tier` starts now: it is background work, so only
        while no other load is in flight or waited for (one at a time, never ahead of a request's), and only
        displacing adapters colder than its record."""
        if self._active:
            return False
        key = ref.sha256
        in_host = self._tiers.tier(key) is not Tier.DISK
        if not in_host and not self._tiers.room_for(key, Tier.HOST, self._host_reservation(ref)):
            return False
        return tier is Tier.HOST or self._tiers.room_for(
            key, Tier.GPU, self._tiers.gpu_size(key) if in_host else self._memory.bytes_at_rank(ref.rank))

    def _host_reservation(self, ref: AdapterRef) -> int:
        """Host bytes a read of `ref` reserves: the most an adapter of its rank can take (the read tells its
        true size)."""
        return self.host_pages.rounded(self._memory.bytes_at_rank(ref.rank))

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
            self._tiers.unpin(key)
        if version.host_preloading and version.host is not None:
            version.host_preloading = False
            self._tiers.unpin(key)

    def _release_orders(self, key: str, version: _Version) -> None:
        """Let go of an operator's pin and preload on `version` (its load failed, or its name was retired)."""
        if version.pinned:
            version.pinned = False
            self._tiers.unpin(key)
        if version.preloading:
            version.preloading = False
            self._tiers.unpin(key)
        if version.host_preloading:
            version.host_preloading = False
            self._tiers.unpin(key)

    def _advance(self, key: str, version: _Version) -> None:
        """Start the next load `version` needs (its requests wait for it), if there is room for it."""
        if version.reading is not None or version.copying is not None or version.usable or self._failures.cause(key):
            return
        if version.host is None:
            if self._tiers.tier(key) is Tier.DISK:
                evicted = self._tiers.place_in_host(key, self._host_reservation(version.ref))
                if evicted is None:
                    return  # host memory is all pinned: a later pass tries again
                for victim in evicted:  # gone from both tiers
                    self._forget(victim)
            version.started = self._clock()
            version.reading = self._loader.submit(self._read_into_host, version.ref)
            if self._synchronous:
                concurrent.futures.wait([version.reading])
                self._read_done(key, version)
                self._advance(key, version)
            else:
                version.reading.add_done_callback(lambda _: self.wake())
            return
        evicted = self._tiers.place_on_gpu(key)
        if evicted is None:
            return  # every GPU byte is pinned: a later pass tries again
        for victim in evicted:  # their host copies stay
            self._free_slot(self._versions[victim])
        slot = self._free_slots.pop()
        version.started = self._clock()
        try:
            copy = self._memory.install(slot, version.host, self._stream)
        except Exception as exc:  # noqa: BLE001 - any failure fails only this version's requests
            self._free_slots.append(slot)
            self._fail(key, version, exc)
            return
        if copy is not None and self._synchronous:
            copy.done.synchronize()
            copy = None
        version.slot, version.copying = slot, copy
        if copy is None:
            self._copied(version)
        else:
            self._copy_waiter.submit(copy.done.synchronize).add_done_callback(lambda _: self.wake())

    def _measure_copy_rate(self) -> float:
        """Bytes/s of one copy of up to COPY_PROBE_BYTES of the page-locked host tier onto the GPU (0: no host tier)."""
        nbytes = min(COPY_PROBE_BYTES, self.host_pages.capacity_bytes)
        if not nbytes:
            return 0.0
        source = self.host_pages.region[:nbytes]
        target = torch.empty(nbytes, dtype=torch.uint8, device=self._memory.device)
        target.copy_(source, non_blocking=True)  # the first copy pays for the path's setup
        started, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        started.record()
        target.copy_(source, non_blocking=True)
        ended.record()
        ended.synchronize()
        return nbytes / (started.elapsed_time(ended) / 1e3)

    def _copied(self, version: _Version) -> None:
        """`version`'s copy onto the GPU has completed: count its time, and its rate for `copy_left_s`."""
        seconds = self._clock() - version.started
        self._load_times.observe("host", seconds)
        if seconds > 0:
            rate = version.host.nbytes / seconds
            self._copy_bytes_per_s = rate if not self._copy_bytes_per_s else 0.8 * self._copy_bytes_per_s + 0.2 * rate

    def _read_into_host(self, ref: AdapterRef) -> PackedAdapter:
        """Loader thread: read, verify and parse `ref`, then hold it in host memory as the GPU wants it."""
        return self._memory.pack(self._read(ref), self.host_pages)

    def _read_done(self, key: str, version: _Version) -> None:
        reading, version.reading = version.reading, None
        error = reading.exception()
        if error is not None:
            self._fail(key, version, error)
            return
        host = reading.result()
        if host.host_bytes > self._tiers.size(key):
            self._fail(key, version, FailedPrecondition(
                f"its weights have rank {host.rank}, the registry recorded rank {version.ref.rank}"))
            return
        version.host = host
        self._failures.succeeded(key)
        self._tiers.resize(key, host.host_bytes, gpu_nbytes=host.nbytes)
        self._load_times.observe("disk", self._clock() - version.started)

    def _fail(self, key: str, version: _Version, error: BaseException) -> None:
        """Remember the failure (requests for `key` fail until its backoff ends) and let go of what the load
        held. One line per failed attempt; a traceback only for an error that is no domain or OS error, once."""
        failure = self._failures.remember(key, error, version.ref.registered_ms)
        unexpected = not isinstance(error, (TesseraError, OSError)) and failure.attempts == 1
        log.error("adapter %s (%s) could not be loaded (attempt %d; failing its requests, next attempt in %.0f s "
                  "at the earliest): %s", ", ".join(sorted(version.names)), version.ref.storage_path,
                  failure.attempts, failure.backoff_s, failure.cause, exc_info=error if unexpected else None)
        version.host = None
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
            self._tiers.drop(key)
            self._forget(key)
        elif self._tiers.tier(key) is Tier.DISK:
            self._forget(key)

    def _forget(self, key: str) -> None:
        """`key` left the host tier (and so the GPU): free its slot, drop its record."""
        version = self._versions.pop(key)
        if version.slot is not None:
            self._free_slot(version)
        self._active.pop(key, None)

    def _free_slot(self, version: _Version) -> None:
        self._memory.free(version.slot)
        self._free_slots.append(version.slot)
        version.slot = version.copying = None
