"""A worker prices itself (gpu_worker/pricing.py): a kind with a committed model takes it; another kind fits
one by a short profile of its own model at start, caches it under its kind and kernel table, and takes the
cached one at the next start without profiling again."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import gpu_worker.pricing as pricing
from gpu_worker.profile import QUICK, grid_plan
from gpu_worker.models.families import load_served_model
from policy.batch_summary import BatchEntry, BatchSummary
from policy.perf_model import PerfModel, perf_model_path
from services.demo_assets import DEMO_BASE_MODEL

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def model(tiny_assets):
    return load_served_model(tiny_assets.base_dir, device=torch.device("cpu"), dtype=torch.float32).language_model


def test_a_committed_kind_takes_its_committed_model(model, tmp_path: Path) -> None:
    resolved = pricing.resolve_perf_model(model, DEMO_BASE_MODEL, 64, TARGETS, tmp_path / "cache")
    assert resolved == PerfModel.load(perf_model_path(f"cpu-{DEMO_BASE_MODEL}"))
    assert not (tmp_path / "cache").exists()


def test_an_operators_profile_in_the_cache_comes_before_the_committed_model(model, tmp_path: Path) -> None:
    """`python -m gpu_worker.profile` writes <cache>/<kind>.json: this machine, measured, wins."""
    committed = PerfModel.load(perf_model_path(f"cpu-{DEMO_BASE_MODEL}"))
    own = dataclasses.replace(committed, source="an operator's profile of this machine")
    (tmp_path / "cache").mkdir()
    own.save(perf_model_path(committed.kind, tmp_path / "cache"))
    assert pricing.resolve_perf_model(model, DEMO_BASE_MODEL, 64, TARGETS, tmp_path / "cache") == own


def test_a_new_kind_profiles_itself_on_a_small_grid_once_then_takes_its_cached_model(model, tmp_path: Path,
                                                                                      monkeypatch) -> None:
    fitted = pricing.resolve_perf_model(model, "tiny-self", 16, TARGETS, tmp_path / "cache")
    # Seconds, by the work it does rather than a clock a busy machine stretches (about 12 s on 2 idle cores,
    # 88 s beside a full test run): the self grid's compositions, fewer than the quick grid's that the
    # committed CPU models were fitted on.
    compositions = len(grid_plan(dataclasses.replace(pricing.SELF_GRID, ranks=(8, 16))))
    assert f": {compositions} steps of tiny-self" in fitted.source
    assert compositions * pricing.SELF_GRID.repeats < len(grid_plan(QUICK)) * QUICK.repeats
    assert fitted.kind == "cpu-tiny-self" and fitted.device == "cpu" and "own profile" in fitted.source
    assert "ranks 8, 16" in fitted.source  # the grid's ranks, within the worker's max_lora_rank
    (cached,) = (tmp_path / "cache").iterdir()
    assert cached.name == f"cpu-tiny-self-{pricing.kernels_key(model)}.json" and PerfModel.load(cached) == fitted
    # What it predicts grows with the work: more requests and more rank cost more.
    small, large = BatchSummary.of([BatchEntry("a", 8, 64)]), BatchSummary.of([BatchEntry(f"a{i}", 16, 64) for i in range(8)])
    assert 0 < fitted.decode_s(small) < fitted.decode_s(large)
    assert 0 < fitted.prefill_s(small) < fitted.prefill_s(large)

    profiles: list[str] = []

    def counted_profile(*args, **kwargs) -> PerfModel:
        profiles.append(args[1])
        return fitted
    monkeypatch.setattr(pricing, "profile_model", counted_profile)
    assert pricing.resolve_perf_model(model, "tiny-self", 16, TARGETS, tmp_path / "cache") == fitted
    assert profiles == []  # the cached model, no profile
    cached.write_text("{not json")  # a damaged cache is profiled again, not trusted
    assert pricing.resolve_perf_model(model, "tiny-self", 16, TARGETS, tmp_path / "cache") == fitted
    assert profiles == ["tiny-self"] and PerfModel.load(cached) == fitted
