"""Adapter loads that failed lately, remembered by version with an exponential backoff: requests for a
version whose files are broken fail at once instead of reading them again, the message says what went
wrong, and the next read waits twice as long as the last, up to a cap:

    ttl 10 s, cap 300 s: attempts at t = 0, 10, 30, 70, 150, 310, 610, 910, ... s

(a tampered adapter that the placement plan kept naming hot was re-read, and a traceback logged, every
11 s). A load that succeeds forgets the version's failures, and so does a newer registration of the same
content (its stored copy replaced by the registry)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from services.common.errors import TesseraError


def cause_of(exc: BaseException) -> str:
    """What went wrong, for the client: a domain error's message, else the exception's type and text
    (an OSError names its file, not the path: the store's layout is no client's business)."""
    if isinstance(exc, TesseraError):
        return exc.message
    if isinstance(exc, OSError) and exc.strerror:
        return f"{type(exc).__name__}: {exc.strerror}" + (f" ({Path(exc.filename).name})" if exc.filename else "")
    return f"{type(exc).__name__}: {exc}"


@dataclass(frozen=True)
class Failure:
    attempts: int       # failed loads of this version in a row
    until: float        # no new load before this (clock time)
    backoff_s: float    # how long this failure is remembered
    cause: str
    registered_ms: int  # the registration whose files failed (the registry's created_unix_ms)


class RecentFailures:
    def __init__(self, ttl_s: float, max_ttl_s: float, clock: Callable[[], float]) -> None:
        """`ttl_s`: how long a first failure is remembered; each failure in a row doubles it, up to `max_ttl_s`."""
        assert 0 <= ttl_s <= max_ttl_s, (ttl_s, max_ttl_s)
        self._ttl_s, self._max_ttl_s = ttl_s, max_ttl_s
        self._clock = clock
        self._failures: dict[str, Failure] = {}  # version -> its last failure
        self._last_until = -math.inf  # the latest backoff's end so far
        self.count = 0  # failures so far

    def remember(self, key: str, error: BaseException, registered_ms: int = 0) -> Failure:
        """A load of `key` (registered at `registered_ms`) failed: the failure, with the backoff before the
        next attempt."""
        self.count += 1
        previous = self._failures.get(key)  # a failure of an older registration starts the count again
        attempts = previous.attempts + 1 if previous is not None and registered_ms <= previous.registered_ms else 1
        backoff_s = min(self._max_ttl_s, self._ttl_s * 2 ** (attempts - 1))
        failure = self._failures[key] = Failure(attempts, self._clock() + backoff_s, backoff_s, cause_of(error),
                                                registered_ms)
        self._last_until = max(self._last_until, failure.until)
        return failure

    def renewed(self, key: str, registered_ms: int) -> None:
        """`key` is asked for under a registration newer than the one that failed: forget the failure."""
        failure = self._failures.get(key)
        if failure is not None and registered_ms > failure.registered_ms:
            del self._failures[key]

    def succeeded(self, key: str) -> None:
        """A load of `key` succeeded: its next failure starts the backoff again."""
        self._failures.pop(key, None)

    def __bool__(self) -> bool:
        """Whether some failure's backoff may still run: if not, `cause` is None for every key."""
        return self._clock() < self._last_until

    def cause(self, key: str) -> str | None:
        """The cause of `key`'s last failed load while no new load may start (its backoff)."""
        failure = self._failures.get(key)
        return failure.cause if failure is not None and self._clock() < failure.until else None
