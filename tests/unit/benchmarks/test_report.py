"""benchmarks/harness/report.py: the one percentile definition every suite reports with."""

from __future__ import annotations

import pytest

from benchmarks.harness.report import percentile


def test_percentiles_interpolate_between_the_nearest_ranks():
    values = [40.0, 10.0, 30.0, 20.0]  # sorted: 10 20 30 40, positions 0..3
    assert percentile(values, 0) == 10.0 and percentile(values, 100) == 40.0
    assert percentile(values, 50) == pytest.approx(25.0)  # the mean of the middle two
    assert percentile(values, 90) == pytest.approx(37.0)  # position 2.7
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(AssertionError):
        percentile([], 50)
