"""Admission: a bounded number of requests in flight per base model, with a retry-after hint
derived from the queue ahead."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import pytest

from gateway.admission import DEFAULT_LATENCY_S, MAX_RETRY_AFTER_S, MIN_RETRY_AFTER_S, Admission
from services.common.errors import ResourceExhausted


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@contextlib.contextmanager
def places_taken(admission: Admission, base_model: str, count: int) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for _ in range(count):
            stack.enter_context(admission.admit(base_model))
        yield


def rejection(admission: Admission, base_model: str) -> ResourceExhausted:
    with pytest.raises(ResourceExhausted) as info:
        with admission.admit(base_model):
            pass
    return info.value


def test_bound_per_base_model_and_places_come_back() -> None:
    admission = Admission(2, Clock())
    with admission.admit("a"), admission.admit("a"), admission.admit("b"):
        error = rejection(admission, "a")
        assert "base model 'a' is overloaded: 2 requests in flight" in error.message
        assert error.retry_after_s == MIN_RETRY_AFTER_S, "nothing has finished yet: the floor"
        assert admission.in_flight("a") == 2
    assert admission.in_flight("a") == 0
    with admission.admit("a"):
        pass


def test_an_error_inside_still_frees_the_place() -> None:
    admission = Admission(1, Clock())
    with pytest.raises(ValueError):
        with admission.admit("a"):
            raise ValueError
    assert admission.in_flight("a") == 0


def test_a_place_frees_every_mean_latency_over_the_bound() -> None:
    clock = Clock()
    admission = Admission(4, clock)
    assert admission.place_interval_s("a") == pytest.approx(DEFAULT_LATENCY_S / 4)
    with admission.admit("a"):
        clock.now += 8.0
    assert admission.place_interval_s("a") == pytest.approx(2.0)


def test_rejected_requests_are_spread_over_the_time_the_queue_ahead_takes() -> None:
    """Bound 4, mean latency 8 s: a place every 2 s. Rejected back to back, the first is told to
    come back in 2 s, the next in 4 s, 6 s, ...: never all at the same moment."""
    clock = Clock()
    admission = Admission(4, clock)
    with admission.admit("a"):
        clock.now += 8.0
    with places_taken(admission, "a", 4):
        hints = [rejection(admission, "a").retry_after_s for _ in range(5)]
        assert hints == pytest.approx([2.0, 4.0, 6.0, 8.0, 10.0])
        clock.now += 5.0  # two places have come and gone: the queue ahead shrank by 5 s
        assert rejection(admission, "a").retry_after_s == pytest.approx(10.0 + 2.0 - 5.0)


def test_hints_stay_within_the_floor_and_the_ceiling() -> None:
    """A fast model (mean 0.5 s, bound 256: a place every 2 ms) is still told at least 1 s, the
    value an HTTP Retry-After can say; a long backlog at most MAX_RETRY_AFTER_S."""
    clock = Clock()
    admission = Admission(256, clock)
    with admission.admit("a"):
        clock.now += 0.5
    with places_taken(admission, "a", 256):
        hints = [rejection(admission, "a").retry_after_s for _ in range(40_000)]
    assert hints[0] == MIN_RETRY_AFTER_S and hints[499] == MIN_RETRY_AFTER_S  # 500 places in the first second
    assert hints[1000] == pytest.approx(1001 * 0.5 / 256)
    assert max(hints) == MAX_RETRY_AFTER_S and hints == sorted(hints)
    assert math.ceil(hints[-1]) == 60
