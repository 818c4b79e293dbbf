"""What the gateway knows about each worker: its latest pushed state, plus what it sent since.

Workers push a `WorkerState` every ~100 ms. Between pushes the gateway keeps routing; so that a
burst does not all land on the worker that looked best at the last push, `WorkerStateTable` adds
each request it dispatched to that worker's queue in its view until a report newer than the
dispatch arrives. A worker whose last report is older than `stale_after_s` is out of rotation
(and forgotten) until it reports again. The clock is injected: `time.monotonic` live, the
simulator's virtual clock in benchmarks.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

from policy.adapter_tiers import Tier
from policy.batch_summary import BatchEntry, BatchSummary


@dataclass(frozen=True)
class WorkerState:
    address: str
    base_model: str
    kind: str                           # the perf model the worker runs under (PerfModel.kind)
    running: tuple[BatchEntry, ...]     # admitted requests; tokens = context so far
    queued: tuple[BatchEntry, ...]      # not yet admitted (incl. waiting for an adapter load); tokens = prompt
    gpu_adapters: frozenset[str]        # on the GPU or being loaded into a GPU slot
    host_adapters: frozenset[str]       # in pinned host memory (a superset of the GPU tier)
    gpu_adapter_slots: int
    max_batch: int
    free_kv_tokens: int
    tightest_tpot_slo_s: float | None   # smallest TPOT SLO among its running and queued requests
    timestamp: float                    # when the worker took this snapshot (the table's clock)
    # On their way to the GPU (disk -> host, or host -> GPU), not usable yet: priced by what is left
    # of their load (tessera_policy.adapter_load_s).
    loading_adapters: frozenset[str] = frozenset()
    # Requests/s expected of the adapter that one more GPU placement would evict (0: a free slot): what a
    # cache miss routed here costs the worker's other adapters (AdapterTiers.gpu_victim_rate).
    gpu_victim_rate: float = 0.0

    @property
    def load(self) -> int:
        return len(self.running) + len(self.queued)

    @functools.cached_property
    def batch(self) -> BatchSummary:
        """The decode batch once everything queued is admitted (queued prompts as contexts)."""
        return BatchSummary.of(self.running + self.queued)

    @functools.cached_property
    def queued_batch(self) -> BatchSummary:
        return BatchSummary.of(self.queued)

    def tier(self, adapter: str) -> Tier:
        if adapter in self.gpu_adapters:
            return Tier.GPU
        return Tier.HOST if adapter in self.host_adapters else Tier.DISK


@dataclass(frozen=True)
class _Dispatch:
    at: float
    entry: BatchEntry
    tpot_slo_s: float


class WorkerStateTable:
    def __init__(self, clock: Callable[[], float], stale_after_s: float = 0.5) -> None:
        assert stale_after_s > 0, "staleness bound must be positive"
        self._clock = clock
        self._stale_after_s = stale_after_s
        self._reports: dict[str, WorkerState] = {}
        self._pending: dict[str, list[_Dispatch]] = {}
        self._views: dict[str, WorkerState] = {}  # report + pending, rebuilt only when either changes

    def report(self, state: WorkerState) -> None:
        """A worker's push. Dispatches before its snapshot are in it; later ones stay pending."""
        last = self._reports.get(state.address)
        if last is not None and last.timestamp > state.timestamp:
            return  # reordered delivery: keep the newer one
        self._reports[state.address] = state
        self._pending[state.address] = [d for d in self._pending.get(state.address, ()) if d.at >= state.timestamp]
        self._views.pop(state.address, None)

    def dispatched(self, address: str, entry: BatchEntry, tpot_slo_s: float) -> None:
        """The gateway sent a request (prompt entry) to `address`."""
        assert address in self._reports, f"dispatch to unknown worker {address}"
        self._pending.setdefault(address, []).append(_Dispatch(self._clock(), entry, tpot_slo_s))
        self._views.pop(address, None)

    def candidates(self, base_model: str) -> list[WorkerState]:
        """Fresh workers serving `base_model`, in address order, each with its pending dispatches."""
        horizon = self._clock() - self._stale_after_s
        for address in [a for a, s in self._reports.items() if s.timestamp < horizon]:
            self.forget(address)
        return [self._view(a) for a in sorted(self._reports) if self._reports[a].base_model == base_model]

    def forget(self, address: str) -> None:
        for table in (self._reports, self._pending, self._views):
            table.pop(address, None)

    def _view(self, address: str) -> WorkerState:
        view = self._views.get(address)
        if view is None:
            state, pending = self._reports[address], self._pending.get(address, [])
            view = state if not pending else dataclasses.replace(
                state,
                queued=state.queued + tuple(d.entry for d in pending),
                gpu_adapters=state.gpu_adapters | {d.entry.adapter for d in pending},
                tightest_tpot_slo_s=min(d.tpot_slo_s for d in pending) if state.tightest_tpot_slo_s is None
                else min(state.tightest_tpot_slo_s, *(d.tpot_slo_s for d in pending)))
            self._views[address] = view
        return view
