"""The worker's adapter memory hierarchy: GPU memory, a host tier, disk, with loads beside serving.

The decisions (which version sits where, which load starts next, what a request finds, failures and their
backoff) are policy/residency.py's, the same state machine the cluster simulator runs. This module is its
I/O (`LoadPort`):
  reads      disk -> host on a loader thread: read, verify against the digest (once, here), parse, copy into
             page-locked host pages (host_weights.py);
  copies     host -> GPU on a side CUDA stream (gpu_memory.py); an event marks each copy's end.
Neither stops a step. `poll` (every scheduling pass, engine thread) reports the reads and copies that
finished to the residency, then lets it start the next loads.

A request's adapter: `arrive` when the request reaches the worker (its load starts), `where` at each
scheduling pass until it runs (usable; or its host copy and pending copy, for a cold start as
policy/cold_start.py decides: the step's projections then wait on the device for their own bytes of the
copy), `depart` when it ends. The registry's orders (policy/placement_orders.py) go to `residency`.

A finished read or copy calls `wake` from its own thread: the engine loop, idle while every request
waits for an adapter, wakes for the next pass (set by the engine that owns the manager).
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

from gpu_worker.lora.adapter_stats import AdapterTierStats, LoadClock
from gpu_worker.lora.gpu_memory import AdapterCopy, GpuAdapterMemory
from gpu_worker.lora.host_weights import PAGE_BYTES, HostPages, PackedAdapter
from gpu_worker.lora.loader import AdapterRef, LoRAWeights
from policy.adapter_tiers import Tier
from policy.eviction import Eviction
from policy.load_failures import Failure
from policy.residency import Residency
from policy.residency_edge import ResidencyLimits, VersionRef
from services.common.errors import AdapterLoadFailed, TesseraError

log = logging.getLogger(__name__)

COPY_PROBE_BYTES = 16 << 20  # the copy that measures host -> GPU bandwidth at start


class AdapterWhere(NamedTuple):  # asked for each waiting request at every pass: a tuple is cheap to build
    """Where a request's adapter version stands now: all the scheduler asks of it."""
    error: AdapterLoadFailed | None  # its load failed lately: fail the request
    slot: int | None                 # its GPU slot once placed (the copy may still run: `copy`)
    rank: int
    usable: bool                     # on the GPU, its copy completed
    host: PackedAdapter | None       # its host copy while it is not usable (CPU-assisted steps)
    copy: AdapterCopy | None         # its copy onto the GPU while it may still run
    copy_left_s: float | None        # about how long that copy still runs; None: no GPU placement yet


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
        doubled at each failure in a row up to `failure_max_ttl_s` (policy/load_failures.py)."""
        assert loader_threads > 0 and 0 <= failure_ttl_s <= failure_max_ttl_s, (loader_threads, failure_ttl_s)
        self._memory = memory
        self._read = read
        cuda = memory.device.type == "cuda"
        # Pages of at most 1/16 of the largest adapter (a 7B's get PAGE_BYTES), so that small models' adapters
        # do not each hold a page many times their size.
        page_bytes = host_page_bytes or max(4096, min(PAGE_BYTES, memory.max_bytes // 16 // 4096 * 4096))
        # Page-locked once, here: see host_weights.py.
        self.host_pages = HostPages(host_bytes, page_locked=cuda, page_bytes=page_bytes, path=host_path)
        self._loader = concurrent.futures.ThreadPoolExecutor(loader_threads, thread_name_prefix="adapter-loader")
        self._stream = torch.cuda.Stream(memory.device) if cuda else None
        # Waits for each copy's event, to wake an idle engine (the engine polls the events itself).
        self._copy_waiter = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="adapter-copy") if cuda else None
        self._synchronous = synchronous
        self._clock = clock
        self._reads: dict[str, concurrent.futures.Future[PackedAdapter]] = {}  # digest -> its read in flight
        self._copies: dict[str, AdapterCopy] = {}   # digest -> its copy onto the GPU, until done
        self._host: dict[str, PackedAdapter] = {}   # digest -> its host copy (its pages return when dropped)
        self._load_times = LoadClock()
        limits = ResidencyLimits(memory.num_slots, memory.budget_bytes, self.host_pages.capacity_bytes,
                                 memory.bytes_of, lambda ref: self.host_pages.rounded(memory.bytes_of(ref)))
        # Host -> GPU installs as measured: at start a copy from the host tier's memory, then each install.
        self.residency = Residency(limits, self, eviction, failure_ttl_s=failure_ttl_s,
                                   failure_max_ttl_s=failure_max_ttl_s, clock=clock,
                                   copy_bytes_per_s=self._measure_copy_rate() if cuda else 0.0)
        self.wake: Callable[[], None] = lambda: None

    # --- a request's adapter ---

    def arrive(self, ref: AdapterRef) -> None:
        self.residency.arrive(ref)

    def where(self, ref: AdapterRef) -> AdapterWhere:
        found = self.residency.status(ref)
        error = None if found.failure is None else AdapterLoadFailed(
            f"adapter {ref.name} could not be loaded: {found.failure}")
        return AdapterWhere(error, found.slot, found.rank, found.usable,
                            None if found.usable else self._host.get(ref.sha256),
                            self._copies.get(ref.sha256), found.copy_left_s)

    def resident(self, ref: AdapterRef) -> tuple[int, int] | None:
        """(GPU slot, rank) of `ref`'s version once usable; None while it loads."""
        found = self.residency.status(ref)
        return (found.slot, found.rank) if found.usable else None

    def failure(self, ref: AdapterRef) -> AdapterLoadFailed | None:
        """The error to fail a request for `ref` with, if its version's load failed lately."""
        return self.where(ref).error

    def depart(self, ref: AdapterRef) -> None:
        self.residency.depart(ref)

    @property
    def failing(self) -> bool:
        """Whether some adapter's failed load may still be in its backoff (if not, `where` fails no request)."""
        return self.residency.failing

    def poll(self) -> None:
        """Report the reads and copies that finished, then start the next loads (every scheduling pass)."""
        for digest, reading in list(self._reads.items()):
            if reading.done():
                del self._reads[digest]
                self._read_finished(digest, reading)
        for digest, copy in list(self._copies.items()):
            if copy.done.query():
                del self._copies[digest]
                self.residency.copy_done(digest)
        self.residency.advance()

    def load_now(self, ref: AdapterRef) -> tuple[int, int]:
        """`arrive`, then wait until the version is usable: (slot, rank). For callers that run steps
        without the engine (the profiler, benchmarks); they `depart` when done. Raises AdapterLoadFailed."""
        self.arrive(ref)
        while (placed := self.resident(ref)) is None:
            if (error := self.failure(ref)) is not None:
                self.depart(ref)
                raise error
            reading, copy = self._reads.get(ref.sha256), self._copies.get(ref.sha256)
            assert reading or copy, f"no room for {ref.name}: every adapter is pinned"
            if reading is not None:
                concurrent.futures.wait([reading])
            else:
                copy.done.synchronize()
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
        residency = self.residency
        placements = residency.placements()
        newest = [p for p in placements if p.newest]  # by name: where a new request finds its adapter
        tiers = residency.tiers
        return AdapterTierStats(
            gpu_adapters=tuple(p.name for p in newest if p.tier is Tier.GPU),
            host_adapters=tuple(p.name for p in newest if p.tier is not Tier.DISK),
            loading_adapters=tuple(p.name for p in newest if p.loading), placements=placements,
            gpu_victim_rate=tiers.gpu_victim_rate(self._clock()),
            gpu_versions=len(tiers.gpu_adapters), host_versions=len(tiers.host_adapters),
            gpu_bytes=tiers.gpu_used, host_bytes=tiers.host_used, gpu_capacity_bytes=tiers.gpu_bytes,
            host_capacity_bytes=tiers.host_bytes, pinned=residency.requests,
            hits=residency.hits, misses=residency.misses, gpu_evictions=tiers.evictions[Tier.GPU],
            gpu_compactions=self._memory.compactions,
            host_evictions=tiers.evictions[Tier.HOST], load_failures=residency.load_failures,
            loads=self._load_times.snapshot())

    # --- the residency's port: reads, copies, and what they leave behind ---

    def start_read(self, ref: VersionRef) -> None:
        reading = self._loader.submit(self._read_into_host, ref)
        self._reads[ref.sha256] = reading
        if self._synchronous:
            concurrent.futures.wait([reading])
        else:
            reading.add_done_callback(lambda _: self.wake())

    def start_copy(self, ref: VersionRef, slot: int) -> bool:
        copy = self._memory.install(slot, self._host[ref.sha256], self._stream)
        if copy is not None and self._synchronous:
            copy.done.synchronize()
            copy = None
        if copy is None:
            return True
        self._copies[ref.sha256] = copy
        self._copy_waiter.submit(copy.done.synchronize).add_done_callback(lambda _: self.wake())
        return False

    def release_slot(self, slot: int) -> None:
        self._memory.free(slot)

    def release_host(self, digest: str) -> None:
        self._host.pop(digest, None)
        self._copies.pop(digest, None)

    def observe_load(self, source: str, seconds: float) -> None:
        self._load_times.observe(source, seconds)

    def load_failed(self, ref: VersionRef, names: list[str], failure: Failure, error: BaseException) -> None:
        """One line per failed attempt; a traceback only for an error that is no domain or OS error, once."""
        unexpected = not isinstance(error, (TesseraError, OSError)) and failure.attempts == 1
        log.error("adapter %s (%s) could not be loaded (attempt %d; failing its requests, next attempt in %.0f s "
                  "at the earliest): %s", ", ".join(names), ref.storage_path, failure.attempts, failure.backoff_s,
                  failure.cause, exc_info=error if unexpected else None)

    # --- loads ---

    def _read_into_host(self, ref: AdapterRef) -> PackedAdapter:
        """Loader thread: read, verify and parse `ref`, then hold it in host memory as the GPU wants it."""
        return self._memory.pack(self._read(ref), self.host_pages)

    def _read_finished(self, digest: str, reading: concurrent.futures.Future[PackedAdapter]) -> None:
        error = reading.exception()
        if error is not None:
            self.residency.read_failed(digest, error)
            return
        host = reading.result()
        self._host[digest] = host  # before the report: a rank check that fails it releases it again
        if not self.residency.read_done(digest, host.host_bytes, host.nbytes, host.rank):
            self._host.pop(digest, None)

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
