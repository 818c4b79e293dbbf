"""A batch as the performance model sees it: entries (adapter, rank, tokens) and their running sums.

`tokens` means the tokens an entry costs in its phase: prompt tokens to prefill, or context tokens
(prompt + generated so far) a decode step attends over. `BatchSummary` keeps the sums every
model term needs, updated in O(1) per entry, so a simulator can advance a running batch one decode
step at a time and a policy can price "this batch plus one request" without rebuilding lists.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BatchEntry:
    adapter: str
    rank: int
    tokens: int

    def __post_init__(self) -> None:
        assert self.rank >= 0 and self.tokens >= 0, f"rank and tokens must be >= 0: {self}"


class BatchSummary:
    """Sums over a batch's entries. Invariant: equal to `BatchSummary.of(entries)` of the entries
    added and not yet removed, with every `advance` applied to the entries present at the time."""

    one = 1  # the intercept's term

    __slots__ = ("requests", "tokens", "tokens_sq", "rank_tokens", "ranks", "distinct_rank",
                 "_rank_counts", "_adapters")

    def __init__(self) -> None:
        self.requests = 0
        self.tokens = 0
        self.tokens_sq = 0
        self.rank_tokens = 0
        self.ranks = 0
        self.distinct_rank = 0  # sum of ranks over distinct adapters: the adapter bytes a step reads
        self._rank_counts: dict[int, int] = {}
        self._adapters: dict[str, int] = {}  # adapter -> entries using it

    @classmethod
    def of(cls, entries: Iterable[BatchEntry]) -> BatchSummary:
        summary = cls()
        for entry in entries:
            summary.add(entry)
        return summary

    def copy(self) -> BatchSummary:
        other = BatchSummary.__new__(BatchSummary)
        other.requests, other.tokens, other.tokens_sq = self.requests, self.tokens, self.tokens_sq
        other.rank_tokens, other.ranks, other.distinct_rank = self.rank_tokens, self.ranks, self.distinct_rank
        other._rank_counts = dict(self._rank_counts)
        other._adapters = dict(self._adapters)
        return other

    def plus(self, entry: BatchEntry) -> BatchSummary:
        """A new summary: this batch with `entry` added."""
        other = self.copy()
        other.add(entry)
        return other

    def add(self, entry: BatchEntry) -> None:
        self._count(entry, +1)

    def remove(self, entry: BatchEntry) -> None:
        assert self._adapters.get(entry.adapter, 0) > 0, f"{entry.adapter} is not in the batch"
        self._count(entry, -1)

    def advance(self) -> None:
        """Every entry's tokens grow by one (a decode step appended a token to each)."""
        self.tokens_sq += 2 * self.tokens + self.requests
        self.tokens += self.requests
        self.rank_tokens += self.ranks

    @property
    def distinct(self) -> int:
        return len(self._adapters)

    @property
    def max_rank(self) -> int:
        return max(self._rank_counts, default=0)

    @property
    def requests_x_max_rank(self) -> int:
        return self.requests * self.max_rank  # the work of a batch padded to its largest rank

    def holds(self, adapter: str) -> bool:
        return adapter in self._adapters

    def _count(self, entry: BatchEntry, sign: int) -> None:
        self.requests += sign
        self.tokens += sign * entry.tokens
        self.tokens_sq += sign * entry.tokens * entry.tokens
        self.rank_tokens += sign * entry.rank * entry.tokens
        self.ranks += sign * entry.rank
        users = self._adapters.get(entry.adapter, 0) + sign
        if users == 0:
            del self._adapters[entry.adapter]
            self.distinct_rank -= entry.rank
        else:
            if users == 1 and sign > 0:
                self.distinct_rank += entry.rank
            self._adapters[entry.adapter] = users
        ranked = self._rank_counts.get(entry.rank, 0) + sign
        if ranked == 0:
            del self._rank_counts[entry.rank]
        else:
            self._rank_counts[entry.rank] = ranked
