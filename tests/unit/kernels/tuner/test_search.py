"""kernels.tuner.search over fake timings: the shortlist, the heuristic's guard, the least regret."""

from __future__ import annotations

import math

import pytest

from kernels import tiling
from kernels.tiling import Bucket, ExpandConfig
from kernels.tuner.candidates import tile_shapes, variants
from kernels.tuner.search import SHORTLIST, BudgetSpent, CheckFailed, regrets, search


def fake_seconds(config) -> float:
    """Deterministic fake timings: bigger splits and 8 warps are faster; block_k 256 fails."""
    if getattr(config, "block_k", 0) == 256:
        raise RuntimeError("out of resource: shared memory\nmore")
    warps_stages = 0.1 * (config.num_warps == 8) + 0.01 * config.num_stages
    return 10.0 - 0.01 * config.split_k - 0.001 * config.block_k - warps_stages  # > 0: regrets are ratios


def test_search_times_the_shortlist_over_warps_and_stages_and_keeps_the_fastest():
    bucket = Bucket("shrink", 4096, (4096,), 64, 8, 1)
    measured, failures = [], []

    def measure(config):
        measured.append(config)
        return (fake_seconds(config),)  # one batch shape

    entry = search(bucket, measure, math.inf, lambda c, e: failures.append((c, str(e))))
    assert len(measured) == len(set(measured))  # nothing timed twice
    heuristic = tiling.heuristic_config(bucket)
    assert measured[0] == heuristic
    stage1 = [c for c in tile_shapes(bucket) if c.block_k != 256]
    shortlist = sorted(stage1, key=fake_seconds)[:SHORTLIST]
    assert set(measured) == {heuristic, *tile_shapes(bucket), *variants("shrink", shortlist)}
    assert {c for c, _ in failures} == {c for c in measured if c.block_k == 256}
    winner = min((c for c in measured if c.block_k != 256), key=fake_seconds)
    assert winner.num_warps == 8 and winner.num_stages == 4  # found by stage 2
    assert tiling.config_from("shrink", entry) == winner
    assert entry["us"] == round(fake_seconds(winner) * 1e6, 3) <= entry["heuristic_us"]
    assert entry["heuristic_us"] == round(fake_seconds(heuristic) * 1e6, 3)
    assert entry["regret"] == 1.0


def test_search_keeps_the_heuristic_when_nothing_beats_it_and_rejects_it_when_it_fails():
    bucket = Bucket("expand", 4096, (4096,), 16, 32, 1)
    heuristic = tiling.heuristic_config(bucket)
    entry = search(bucket, lambda c: (1.0 if c == heuristic else 2.0,), math.inf, lambda c, e: None)
    assert tiling.config_from("expand", entry) == heuristic and entry["us"] == entry["heuristic_us"] == 1e6

    def broken(config):
        if config == heuristic:
            raise RuntimeError("boom")
        return (1.0,)

    with pytest.raises(CheckFailed, match="heuristic"):
        search(bucket, broken, math.inf, lambda c, e: None)
    with pytest.raises(BudgetSpent):
        search(bucket, lambda c: (1.0,), -math.inf, lambda c, e: None)


def test_regrets_are_worst_ratios_to_each_shapes_best():
    a, b, c = (ExpandConfig(16, 64, n, 4, 2) for n in (1, 2, 4))
    assert regrets({a: (10.0, 30.0), b: (12.0, 24.0), c: (20.0, 24.0)}) == pytest.approx({a: 1.25, b: 1.2, c: 2.0})


def test_search_keeps_the_configuration_with_the_least_worst_case_regret_not_the_least_mean():
    # The first shape's times are larger, so a mean follows it; the regret weighs both shapes alike.
    bucket = Bucket("shrink", 4096, (4096,), 64, 8192, 2048)
    heuristic = tiling.heuristic_config(bucket)
    first_shape_fast, robust = [c for c in tile_shapes(bucket) if c != heuristic][:2]
    times = {first_shape_fast: (10.0, 6.0), robust: (12.0, 4.8)}  # means 8 and 8.4; regrets 1.25 and 1.2
    entry = search(bucket, lambda c: times.get(c, (30.0, 30.0)), math.inf, lambda c, e: None)
    assert tiling.config_from("shrink", entry) == robust
    assert entry["regret"] == 1.2 and entry["us"] == round(8.4 * 1e6, 3) and entry["heuristic_us"] == 30e6
    assert entry["shape_us"] == [12e6, 4.8e6]
