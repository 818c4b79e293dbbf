"""What a suite prints and writes: progress lines, rows as they are measured, percentiles (one
definition for every suite), a markdown table, the JSON report.

Percentiles interpolate linearly between the two nearest ranks (numpy's default, Hyndman and Fan's
type 7): p of n sorted values sits at position p / 100 * (n - 1), so p0 is the least, p100 the
largest, and p50 of an even count the mean of the middle two.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0 <= q <= 100) of a non-empty sample (the module's definition)."""
    assert len(values) > 0, "the percentile of no values"
    return float(np.percentile(values, q))


def progress(line: str, _started: float = time.perf_counter()) -> None:
    """`line` after the seconds since the suite started: what a long run is doing, as it does it."""
    print(f"[{time.perf_counter() - _started:6.1f} s] {line}", flush=True)


@dataclass
class Report:
    """A run's rows, each printed as it is measured (name=value, floats to 4 figures)."""
    device: str
    rows: list[dict] = field(default_factory=list)

    def add(self, **row) -> None:
        self.rows.append(row)
        print("  " + "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
              flush=True)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub markdown table of `rows` (cells already formatted) under `header`."""
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
                      *("| " + " | ".join(cells) + " |" for cells in rows)])


def write_json(path: Path | None, report: object) -> None:
    """The report to `path` (a suite's --json), if one was given."""
    if path is not None:
        path.write_text(json.dumps(report, indent=1))
