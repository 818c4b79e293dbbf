"""Admission control: a bounded number of requests in flight per base model at this gateway.

Workers queue what they cannot batch yet; the gateway bounds how much it hands them, so an
overload is a fast, clear "overloaded, retry after N s" (HTTP 429 / RESOURCE_EXHAUSTED) instead
of requests piling up until they time out. Every admitted request keeps its place to the end.

The retry-after hint is the expected wait of the queue ahead. With the bound's requests in flight,
a place frees every mean latency / bound seconds; a rejected request is promised the first place
not already promised to those rejected before it, and told to come back then:

    bound 256, mean latency 2 s: a place frees every 7.8 ms. 1,000 requests rejected at once are
    told 1 s (the floor) for the first 128, then 2 s, ..., 8 s for the last: they come back spread
    over the 8 s the queue takes to drain, instead of all together 8 ms later.

The floor (MIN_RETRY_AFTER_S) keeps any one hint from inviting a retry storm; the ceiling keeps
clients who never came back from pushing every later hint out for ever.
"""

from __future__ import annotations

import collections
import contextlib
import math
import time
from collections.abc import Callable, Iterator

from services.common.errors import ResourceExhausted

LATENCY_EWMA_WEIGHT = 0.1  # of the newest request in the running mean latency
DEFAULT_LATENCY_S = 1.0  # the mean latency assumed before any request of a base model has finished
MIN_RETRY_AFTER_S = 1.0
MAX_RETRY_AFTER_S = 60.0


class Admission:
    """Runs on the event loop only."""

    def __init__(self, max_queued: int, clock: Callable[[], float] = time.monotonic) -> None:
        assert max_queued >= 1, "checked with the gateway's config"
        self._max_queued = max_queued
        self._clock = clock
        self._in_flight: collections.Counter[str] = collections.Counter()
        self._mean_latency_s: dict[str, float] = {}
        self._last_promise: dict[str, float] = {}  # base model -> the latest place promised (clock time)

    @contextlib.contextmanager
    def admit(self, base_model: str) -> Iterator[None]:
        """Hold one of `base_model`'s places for the block; ResourceExhausted if none is free."""
        if self._in_flight[base_model] >= self._max_queued:
            retry_after_s = self._promise_place(base_model)
            raise ResourceExhausted(
                f"base model '{base_model}' is overloaded: {self._max_queued} requests in flight at this gateway; "
                f"retry after {math.ceil(retry_after_s)} s", retry_after_s=retry_after_s)
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

    def place_interval_s(self, base_model: str) -> float:
        """How often a place frees while all are taken: the requests in flight finish one after another."""
        return self._mean_latency_s.get(base_model, DEFAULT_LATENCY_S) / self._max_queued

    def _promise_place(self, base_model: str) -> float:
        """Promise the next free place to a rejected request; the seconds until it comes, within the bounds."""
        now = self._clock()
        place = max(now, self._last_promise.get(base_model, now)) + self.place_interval_s(base_model)
        self._last_promise[base_model] = place = min(place, now + MAX_RETRY_AFTER_S)
        return max(MIN_RETRY_AFTER_S, place - now)

    def in_flight(self, base_model: str) -> int:
        return self._in_flight[base_model]
