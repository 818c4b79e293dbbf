"""`python -m gpu_worker.profile`: the real engine over a grid of batches, fitted and written as JSON."""

from __future__ import annotations

import json
import shutil

import pytest

from policy.perf_model import FORMS, PERF_MODELS_DIR, PerfModel, perf_model_path
from gpu_worker.device_kind import perf_model_kind
from gpu_worker.profile import TINY, adapter_cases, main
from services.demo_assets import DEMO_BASE_MODEL


@pytest.mark.parametrize("random_weights", [False, True])
def test_profile_writes_a_fit_with_r2_and_samples(tiny_assets, tmp_path, capsys, random_weights: bool) -> None:
    out = tmp_path / "cpu.json"
    model_dir = tiny_assets.base_dir
    if random_weights:  # the config alone: no weights to load
        model_dir = tmp_path / "config-only"
        model_dir.mkdir()
        shutil.copy(tiny_assets.base_dir / "config.json", model_dir)
    assert main(["--model", str(model_dir), "--base-model", DEMO_BASE_MODEL, "--out", str(out), "--grid", "tiny"]
                + ["--random-weights"] * random_weights) == 0
    data = json.loads(out.read_text())
    assert data["kind"] == perf_model_kind("cpu", DEMO_BASE_MODEL) == "cpu-tessera-demo-llama"
    assert data["device"] == "cpu" and "gpu_worker.profile" in data["source"]
    assert ("random weights" in data["source"]) == random_weights
    compositions = {phase: sum(len(list(adapter_cases(b, TINY.ranks))) * len(lens) for b in batches)
                    for phase, batches, lens in (("prefill", TINY.prefill_batches, TINY.prompt_lens),
                                                 ("decode", TINY.decode_batches, TINY.context_lens))}
    for phase in ("prefill", "decode"):
        fit = data[phase]
        assert fit["samples"] == compositions[phase]
        assert set(fit["r2_by_form"]) == set(FORMS[phase]) and fit["form"] in FORMS[phase]
        assert fit["r2"] == fit["r2_by_form"][fit["form"]]  # chosen by adjusted R², reported as R²
        assert -1.0 <= fit["r2"] <= 1.0
    model = PerfModel.load(out)  # the gateway loads what the profiler writes
    assert model.decode.samples == compositions["decode"]
    printed = capsys.readouterr().out
    assert "prefill: chose" in printed and "decode: chose" in printed and "R²=" in printed


def test_profile_writes_to_the_homes_cache_by_default_never_the_committed_models(tiny_assets, tmp_path, monkeypatch,
                                                                                  capsys) -> None:
    committed = perf_model_path("cpu-tessera-demo-llama", PERF_MODELS_DIR)
    before = committed.read_bytes()
    monkeypatch.setenv("TESSERA_HOME", str(tmp_path))
    assert main(["--model", str(tiny_assets.base_dir), "--base-model", DEMO_BASE_MODEL, "--grid", "tiny"]) == 0
    written = tmp_path / "perf_models" / "cpu-tessera-demo-llama.json"
    assert PerfModel.load(written).kind == "cpu-tessera-demo-llama" and committed.read_bytes() == before
    assert f"to ship it, commit it as {committed}" in capsys.readouterr().out


def test_adapter_cases_cover_base_shared_own_and_mixed() -> None:
    cases = dict(adapter_cases(2, (8, 64)))
    assert cases["base"] == [None, None]
    assert cases["shared-r8"] == [("shared-r8", 8)] * 2
    assert cases["own-r64"] == [("own-r64-0", 64), ("own-r64-1", 64)]
    assert [a[1] for a in cases["mixed"]] == [8, 64]
    assert set(dict(adapter_cases(1, (8,)))) == {"base", "shared-r8"}
