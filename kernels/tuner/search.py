"""The two-stage search of one bucket: its candidates timed, the configuration of least regret kept."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Sequence

from kernels import tiling
from kernels.tiling import Bucket, Config
from kernels.tuner.candidates import tile_shapes, variants

SHORTLIST = 2  # stage-1 shapes that go on to stage 2


class CheckFailed(Exception):
    """A bucket's heuristic configuration disagrees with the reference (or cannot run): not tuned."""


class BudgetSpent(Exception):
    """The --time-budget ran out in the middle of a bucket."""


def first_line(exc: Exception) -> str:
    """The exception's type and the first line of its message: one line of a note."""
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"


def search(bucket: Bucket, measure: Callable[[Config], Sequence[float]], deadline: float,
           on_failure: Callable[[Config, Exception], None]) -> dict:
    """The bucket's table entry: the chosen configuration's fields, its mean time over the batch
    shapes ("us", likewise "heuristic_us"), its time on each ("shape_us") and its "regret".

    measure(config) -> seconds per call on each of the bucket's batch shapes. The choice is the
    configuration whose worst time over the shapes, relative to the best any configuration took on
    that shape, is least (`regrets`): one configuration serves every batch of the bucket. A
    configuration `measure` fails on (out of shared memory, ...) is reported and skipped. Raises
    BudgetSpent once time.monotonic() passes `deadline`.
    """
    heuristic = tiling.heuristic_config(bucket)
    seconds: dict[Config, tuple[float, ...]] = {}
    failed: set[Config] = set()

    def time_all(configs: Iterable[Config]) -> None:
        for config in configs:
            if config in seconds or config in failed:
                continue
            if time.monotonic() > deadline:
                raise BudgetSpent
            try:
                seconds[config] = tuple(measure(config))
            except Exception as exc:  # a config that cannot compile or run is a loser, not an error
                failed.add(config)
                on_failure(config, exc)

    def ranked(configs: Iterable[Config]) -> list[Config]:
        regret = regrets(seconds)
        return sorted((c for c in configs if c in seconds), key=lambda c: (regret[c], statistics.fmean(seconds[c])))

    stage1 = tile_shapes(bucket)
    time_all([heuristic, *stage1])
    if heuristic not in seconds:
        raise CheckFailed(f"{bucket.key}: the heuristic {heuristic} could not be timed")
    time_all(variants(bucket.op, ranked(stage1)[:SHORTLIST]))
    winner = ranked(seconds)[0]
    return {**tiling.config_dict(winner), "us": round(statistics.fmean(seconds[winner]) * 1e6, 3),
            "heuristic_us": round(statistics.fmean(seconds[heuristic]) * 1e6, 3),
            "regret": round(regrets(seconds)[winner], 3),
            "shape_us": [round(t * 1e6, 3) for t in seconds[winner]]}


def regrets(seconds: dict[Config, tuple[float, ...]]) -> dict[Config, float]:
    """Each configuration's worst ratio, over the batch shapes, of its time to the least time any
    configuration took on that shape. Example: times (10, 30) and (12, 24) -> regrets 1.25, 1.2."""
    best = [min(times) for times in zip(*seconds.values())]
    return {config: max(t / b for t, b in zip(times, best)) for config, times in seconds.items()}
