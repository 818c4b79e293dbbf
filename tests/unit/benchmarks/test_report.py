"""benchmarks/harness/report.py: the one percentile definition every suite reports with, and the
markdown table placement_live prints."""

from __future__ import annotations

import pytest

from benchmarks.harness.report import markdown_table, percentile


def test_percentiles_interpolate_between_the_nearest_ranks():
    values = [40.0, 10.0, 30.0, 20.0]  # sorted: 10 20 30 40, positions 0..3
    assert percentile(values, 0) == 10.0 and percentile(values, 100) == 40.0
    assert percentile(values, 50) == pytest.approx(25.0)  # the mean of the middle two
    assert percentile(values, 90) == pytest.approx(37.0)  # position 2.7
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(AssertionError):
        percentile([], 50)


def test_markdown_table_rows_under_their_header():
    assert markdown_table(["policy", "within SLO"], [["tessera", "**97.5%**"], ["most-idle", "100.0%"]]) == (
        "| policy | within SLO |\n|---|---|\n| tessera | **97.5%** |\n| most-idle | 100.0% |")
