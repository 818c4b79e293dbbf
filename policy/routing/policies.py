"""Routing policies: which worker gets a request, from the workers' reported state alone.

Every policy answers `choose(request, candidates)` over the fresh workers serving the request's
base model (`WorkerStateTable.candidates`, address order). The baselines here are the ones the
literature compares against; `tessera_policy.TesseraPolicy` is ours. Ties among equally good
workers go round-robin, so no worker is favoured by its place in the list.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from policy.batch_summary import BatchEntry
from policy.routing.worker_state import WorkerState


@dataclass(frozen=True)
class Slo:
    tpot_s: float  # mean time per output token after the first
    ttft_s: float  # time to first token


@dataclass(frozen=True)
class RoutingRequest:
    adapter: str
    rank: int
    prompt_tokens: int
    expected_output_tokens: int  # the gateway's estimate (max_tokens or a running mean), not the truth
    slo: Slo

    @property
    def entry(self) -> BatchEntry:
        return BatchEntry(self.adapter, self.rank, self.prompt_tokens)


class Policy(Protocol):
    name: str

    def choose(self, request: RoutingRequest, candidates: Sequence[WorkerState]) -> WorkerState:
        """One of `candidates` (never empty: the caller answers "unavailable" when none is fresh)."""


class Rotation:
    """Round-robin among the candidates tied for the lowest key (as LeastInFlightRouter does)."""

    def __init__(self) -> None:
        self._turn = 0

    def pick_min(self, candidates: Sequence[WorkerState], key: Callable[[WorkerState], float]) -> WorkerState:
        assert candidates, "no candidate workers"
        keys = [key(w) for w in candidates]
        best = min(keys)
        tied = [w for w, k in zip(candidates, keys) if k == best]
        choice = tied[self._turn % len(tied)]
        self._turn += 1
        return choice


class RoundRobin:
    name = "round-robin"

    def __init__(self) -> None:
        self._rotation = Rotation()

    def choose(self, request: RoutingRequest, candidates: Sequence[WorkerState]) -> WorkerState:
        return self._rotation.pick_min(candidates, key=lambda w: 0)


class RandomChoice:
    name = "random"

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)

    def choose(self, request: RoutingRequest, candidates: Sequence[WorkerState]) -> WorkerState:
        assert candidates, "no candidate workers"
        return self._rng.choice(candidates)


class MostIdle:
    """Fewest running + queued requests."""

    name = "most-idle"

    def __init__(self) -> None:
        self._rotation = Rotation()

    def choose(self, request: RoutingRequest, candidates: Sequence[WorkerState]) -> WorkerState:
        return self._rotation.pick_min(candidates, key=lambda w: w.load)


class FirstFit:
    """Punica's: the first worker, in fixed (address) order, whose batch has room below `max_batch`;
    when none has, the least loaded (Punica would hold the request back; this interface must pick)."""

    name = "first-fit"

    def __init__(self, max_batch: int = 32) -> None:
        assert max_batch >= 1
        self._max_batch = max_batch
        self._rotation = Rotation()

    def choose(self, request: RoutingRequest, candidates: Sequence[WorkerState]) -> WorkerState:
        for worker in candidates:
            if worker.load < self._max_batch:
                return worker
        return self._rotation.pick_min(candidates, key=lambda w: w.load)


class LeastLoadedLRUAffinity:
    """Least loaded, but a worker already holding the adapter on its GPU wins while its load is within
    `slack` requests of the least loaded: the cache-affinity router of systems whose worker caches
    are LRU (which cache the workers run is theirs, not the policy's: see AdapterTiers)."""

    name = "least-loaded-lru"

    def __init__(self, slack: int = 2) -> None:
        assert slack >= 0
        self._slack = slack
        self._rotation = Rotation()

    def choose(self, request: RoutingRequest, candidates: Sequence[WorkerState]) -> WorkerState:
        least = min(w.load for w in candidates)
        holders = [w for w in candidates if request.adapter in w.gpu_adapters and w.load <= least + self._slack]
        return self._rotation.pick_min(holders or candidates, key=lambda w: w.load)
