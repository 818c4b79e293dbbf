"""Admission control: a bounded number of requests in flight per base model at this gateway.

Workers queue what they cannot batch yet; the gateway bounds how much it hands them, so an
overload is a fast, clear "overloaded, retry after ~N s" (HTTP 429 / RESOURCE_EXHAUSTED) instead
of requests piling up until they time out. Every admitted request keeps its place to the end.
The retry-after hint is the expected wait for one slot: with the bound's requests in flight and
finishing one after another, one frees every mean-latency / bound seconds.
"""

from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import Callable, Iterator

from services.common.errors import ResourceExhausted

LATENCY_EWMA_WEIGHT = 0.1  # of the newest request in the running mean latency
DEFAULT_RETRY_AFTER_S = 1.0  # before any request has finished


class Admission:
    """Runs on the event loop only."""

    def __init__(self, max_queued: int, clock: Callable[[], float] = time.monotonic) -> None:
        assert max_queued >= 1, "checked with the gateway's config"
        self._max_queued = max_queued
        self._clock = clock
        self._in_flight: collections.Counter[str] = collections.Counter()
        self._mean_latency_s: dict[str, float] = {}

    @contextlib.contextmanager
    def admit(self, base_model: str) -> Iterator[None]:
        """Hold one of `base_model`'s places for the block; ResourceExhausted if none is free."""
        if self._in_flight[base_model] >= self._max_queued:
            retry_after_s = self.retry_after_s(base_model)
            raise ResourceExhausted(
                f"base model '{base_model}' is overloaded: {self._max_queued} requests in flight at this gateway; "
                f"retry after {retry_after_s:.1f} s", retry_after_s=retry_after_s)
        self._in_flight[base_model] += 1
        started = self._clock()
        try:
            yield
        finally:
            self._in_flight[base_model] -= 1
            latency = self._clock() - started
            mean = self._mean_latency_s.get(base_model)
            self._mean_latency_s[base_model] = latency if mean is None else (
                mean + LATENCY_EWMA_WEIGHT * (latency - mean))

    def retry_after_s(self, base_model: str) -> float:
        mean = self._mean_latency_s.get(base_model)
        return DEFAULT_RETRY_AFTER_S if mean is None else mean / self._max_queued

    def in_flight(self, base_model: str) -> int:
        return self._in_flight[base_model]
