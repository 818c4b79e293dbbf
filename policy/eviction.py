"""Which adapter leaves a full tier first: eviction policies over per-adapter access records.

Placement follows access frequency (ROCK): each access adds 1 to an adapter's score, and scores
decay with a half-life, so an adapter that was hot an hour ago does not squat on a GPU slot. LRU is
kept for comparison (the score is then just the last access time). Shared by the gateway's cluster
model (adapter_tiers.py, the simulator) and the worker's adapter pool.
"""

from __future__ import annotations

import math
from typing import Protocol

Record = tuple[float, float]  # (score at time `at`, at)


class Eviction(Protocol):
    """Scores accesses; the adapter with the lowest `keep` key is evicted first."""

    def touched(self, record: Record | None, now: float) -> Record: ...

    def keep(self, record: Record) -> float: ...

    def expected(self, rate: float, now: float) -> Record:
        """The record of an adapter requested at a steady `rate` per second until `now` (a placement plan's
        expectation, weighed against the records of what it would displace)."""
        ...

    def rate(self, record: Record, now: float) -> float:
        """The requests/s an adapter with `record` is expected to get from `now` on (the inverse of `expected`)."""
        ...


class LFUDecay:
    """Access count with exponential decay: score(now) = Σ_accesses 2^(-(now - t) / half_life)."""

    def __init__(self, half_life_s: float) -> None:
        assert half_life_s > 0, "half-life must be positive"
        self._half_life_s = half_life_s

    def touched(self, record: Record | None, now: float) -> Record:
        if record is None:
            return 1.0, now
        score, at = record
        return score * 2.0 ** (-(now - at) / self._half_life_s) + 1.0, now

    def expected(self, rate: float, now: float) -> Record:
        # Σ_k 2^(-k / (rate · half_life)) over accesses 1/rate apart ≈ rate · half_life / ln 2.
        return rate * self._half_life_s / math.log(2), now

    def rate(self, record: Record, now: float) -> float:
        score, at = record
        return score * 2.0 ** (-(now - at) / self._half_life_s) * math.log(2) / self._half_life_s

    def keep(self, record: Record) -> float:
        # log2 of the score brought to a common time: the order of scores at any `now`, without `now`.
        score, at = record
        return math.log2(score) + at / self._half_life_s


MIN_GAP_S = 1e-3  # an access this recent reads as 1,000 requests/s: the rate of one just touched stays finite


class LRU:
    def touched(self, record: Record | None, now: float) -> Record:
        return 1.0, now

    def expected(self, rate: float, now: float) -> Record:
        return 1.0, now - 1.0 / rate  # the mean time since the last of steady arrivals at `rate`

    def rate(self, record: Record, now: float) -> float:
        return 1.0 / max(now - record[1], MIN_GAP_S)

    def keep(self, record: Record) -> float:
        return record[1]
