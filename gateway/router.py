"""Which worker serves a request: the scheduling hook of the gateway.

`Router` is the interface the core calls; `LeastInFlightRouter` is the first policy (least
requests in flight from this gateway, ties round-robin). Rank- and SLO-aware policies plug
in behind the same three calls: `pick`, `started`/`finished`, `mark_down`.
"""

from __future__ import annotations

import collections
import itertools
import time
from collections.abc import Sequence
from typing import Protocol

from services.errors import Unavailable
from tessera.v1 import common_pb2

MARK_DOWN_S = 2.0  # a worker that just failed with UNAVAILABLE is skipped this long


class Router(Protocol):
    def pick(self, base_model: str, workers: Sequence[common_pb2.WorkerInfo]) -> common_pb2.WorkerInfo:
        """Choose among healthy `workers` serving `base_model`; Unavailable if none fits."""

    def started(self, address: str) -> None:
        """A request was sent to the worker at `address`."""

    def finished(self, address: str) -> None:
        """That request ended (any outcome)."""

    def mark_down(self, address: str) -> None:
        """The worker failed with UNAVAILABLE: avoid it for a short while."""


class LeastInFlightRouter:
    """Least in-flight requests first; ties broken round-robin. Runs on the event loop only."""

    def __init__(self, mark_down_s: float = MARK_DOWN_S) -> None:
        self._mark_down_s = mark_down_s
        self._in_flight: collections.Counter[str] = collections.Counter()
        self._down_until: dict[str, float] = {}
        self._turn = itertools.count()

    def pick(self, base_model: str, workers: Sequence[common_pb2.WorkerInfo]) -> common_pb2.WorkerInfo:
        now = time.monotonic()
        up = [w for w in workers if self._down_until.get(w.address, 0.0) <= now]
        if not up:
            down = f" ({len(workers)} recently failed)" if workers else ""
            raise Unavailable(f"no healthy worker serves base model '{base_model}'{down}; retry shortly")
        fewest = min(self._in_flight[w.address] for w in up)
        # Sorted so the round-robin order does not depend on the registry's listing order.
        tied = sorted((w for w in up if self._in_flight[w.address] == fewest), key=lambda w: w.address)
        return tied[next(self._turn) % len(tied)]

    def started(self, address: str) -> None:
        self._in_flight[address] += 1

    def finished(self, address: str) -> None:
        self._in_flight[address] -= 1
        assert self._in_flight[address] >= 0, f"in-flight count for {address} went negative"
        if self._in_flight[address] == 0:
            del self._in_flight[address]

    def mark_down(self, address: str) -> None:
        self._down_until[address] = time.monotonic() + self._mark_down_s

    def in_flight(self, address: str) -> int:
        return self._in_flight[address]
