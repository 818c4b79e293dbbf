"""Admission: a bounded number of requests in flight per base model, with a retry-after hint."""

from __future__ import annotations

import pytest

from gateway.admission import DEFAULT_RETRY_AFTER_S, Admission
from services.common.errors import ResourceExhausted


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_bound_per_base_model_and_places_come_back() -> None:
    admission = Admission(2, Clock())
    with admission.admit("a"), admission.admit("a"), admission.admit("b"):
        with pytest.raises(ResourceExhausted, match="base model 'a' is overloaded: 2 requests in flight") as info:
            with admission.admit("a"):
                pass
        assert info.value.retry_after_s == DEFAULT_RETRY_AFTER_S
        assert admission.in_flight("a") == 2
    assert admission.in_flight("a") == 0
    with admission.admit("a"):
        pass


def test_retry_after_is_the_mean_latency_over_the_bound() -> None:
    clock = Clock()
    admission = Admission(4, clock)
    with admission.admit("a"):
        clock.now += 8.0
    assert admission.retry_after_s("a") == pytest.approx(2.0)
    with pytest.raises(ValueError):  # an error inside still frees the place
        with admission.admit("a"):
            raise ValueError
    assert admission.in_flight("a") == 0
