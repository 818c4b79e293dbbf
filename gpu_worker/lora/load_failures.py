"""Adapter loads that failed lately, remembered by version for a while: requests for a version whose
files are broken fail at once instead of reading them again, and the message says what went wrong."""

from __future__ import annotations

from collections.abc import Callable
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


class RecentFailures:
    def __init__(self, ttl_s: float, clock: Callable[[], float]) -> None:
        assert ttl_s >= 0, ttl_s
        self._ttl_s = ttl_s
        self._clock = clock
        self._failures: dict[str, tuple[float, str]] = {}  # version -> (remembered until, cause)
        self.count = 0  # failures so far

    def remember(self, key: str, error: BaseException) -> None:
        self.count += 1
        self._failures[key] = (self._clock() + self._ttl_s, cause_of(error))

    def cause(self, key: str) -> str | None:
        """The cause of `key`'s last failed load, while it is remembered."""
        failure = self._failures.get(key)
        if failure is not None and failure[0] <= self._clock():
            del self._failures[key]
            failure = None
        return failure[1] if failure else None
