"""Which worker serves a request: a scheduling policy over the workers' pushed state.

The registry says which workers are healthy and serve the base model; the WorkerStateTable (fed
by gateway/state_feed.py) says what each is running, queueing and holding, plus what this gateway
sent it since; the policy — `gateway.routing_policy`, the very classes the cluster simulator runs
(policy/routing/) — picks among the workers with a fresh state. A worker that failed with
UNAVAILABLE is skipped for `mark_down_s`; the core then retries on another.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Mapping, Sequence

from services.common.config import ConfigError
from services.common.errors import Unavailable
from policy.adapter_tiers import LoadCosts
from policy.perf_model import PerfModel
from tessera.v1 import common_pb2

from policy.routing.policies import (FirstFit, LeastLoadedLRUAffinity, MostIdle, Policy, RandomChoice,
                                     RoundRobin, RoutingRequest)
from policy.routing.tessera_policy import TesseraPolicy
from policy.routing.worker_state import WorkerStateTable

MARK_DOWN_S = 2.0  # a worker that just failed with UNAVAILABLE is skipped this long

POLICIES: dict[str, Callable[[Mapping[str, PerfModel]], Policy]] = {
    "tessera": lambda models: TesseraPolicy(models, LoadCosts()),
    "most-idle": lambda models: MostIdle(),
    "round-robin": lambda models: RoundRobin(),
    "random": lambda models: RandomChoice(seed=0),
    "first-fit": lambda models: FirstFit(),
    "least-loaded-lru": lambda models: LeastLoadedLRUAffinity(),
}
NEEDS_PERF_MODELS = frozenset({"tessera"})



def build_policy(name: str, models: Mapping[str, PerfModel]) -> Policy:
    """`models`: each worker kind's performance model; a priced policy reads it as workers add theirs."""
    factory = POLICIES.get(name)
    if factory is None:
        raise ConfigError(f"gateway.routing_policy: unknown policy '{name}'; known: {', '.join(POLICIES)}")
    return factory(models)


class Router:
    """Runs on the event loop only."""

    def __init__(self, policy: Policy, table: WorkerStateTable, mark_down_s: float = MARK_DOWN_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._policy = policy
        self.table = table
        self._mark_down_s = mark_down_s
        self._clock = clock
        self._down_until: dict[str, float] = {}
        self._tpot_slos: dict[str, dict[str, float]] = collections.defaultdict(dict)  # address -> id -> SLO

    def pick(self, request: RoutingRequest, base_model: str,
             workers: Sequence[common_pb2.WorkerInfo]) -> common_pb2.WorkerInfo:
        """Choose among the registry's healthy `workers` serving `base_model`; Unavailable if none fits."""
        now = self._clock()
        up = {w.address: w for w in workers if self._down_until.get(w.address, 0.0) <= now}
        if not workers:
            raise Unavailable(f"no live worker serves base model '{base_model}': start one (`tessera up` starts one "
                              f"for each registered base model; or `tessera serve worker` with "
                              f"TESSERA_WORKER__BASE_MODEL={base_model})")
        if not up:
            raise Unavailable(f"no healthy worker serves base model '{base_model}' ({len(workers)} recently "
                              f"failed); retry shortly")
        candidates = [s for s in self.table.candidates(base_model) if s.address in up]
        if not candidates:
            raise Unavailable(f"no healthy worker serves base model '{base_model}' ({len(up)} registered, none "
                              f"reporting its state); retry shortly")
        choice = self._policy.choose(request, candidates)
        self.table.dispatched(choice.address, request.entry, request.slo.tpot_s)
        return up[choice.address]

    def started(self, address: str, request_id: str, tpot_slo_s: float) -> None:
        """The request was sent to the worker at `address`."""
        self._tpot_slos[address][request_id] = tpot_slo_s

    def finished(self, address: str, request_id: str) -> None:
        """That request ended (any outcome)."""
        slos = self._tpot_slos[address]
        del slos[request_id]
        if not slos:
            del self._tpot_slos[address]

    def mark_down(self, address: str) -> None:
        """The worker failed with UNAVAILABLE: avoid it for a short while."""
        self._down_until[address] = self._clock() + self._mark_down_s

    def tightest_tpot_slo_s(self, address: str) -> float | None:
        """The smallest TPOT SLO among this gateway's requests in flight on `address`."""
        slos = self._tpot_slos.get(address)
        return min(slos.values()) if slos else None

    def in_flight(self, address: str) -> int:
        return len(self._tpot_slos.get(address, ()))
