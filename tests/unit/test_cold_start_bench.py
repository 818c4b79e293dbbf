"""benchmarks/cold_start_bench.py on CPU: the smoke path end to end (a tiny random model, real PEFT
files read, verified and parsed by the worker's loader), and the benchmark's adapter files against
what PEFT itself saves for the same model."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from peft import LoraConfig
from safetensors.torch import load_file
from transformers import AutoConfig

from benchmarks import cold_start_bench as bench
from benchmarks.adapter_files import ALL_SEVEN, AdapterShape, AdapterStore
from services.common.adapter_layout import WEIGHTS_FILE, directory_digest
from services.demo_assets import DemoAdapterSpec, LlamaShape, build_llama, build_lora_adapter


def _figures(node: object, path: str = "") -> list[tuple[str, float]]:
    """Every number in the report with its path, except event counts (which may be 0)."""
    if isinstance(node, dict):
        return [f for key, value in node.items() if key != "counts" for f in _figures(value, f"{path}.{key}")]
    if isinstance(node, list):
        return [f for i, value in enumerate(node) for f in _figures(value, f"{path}[{i}]")]
    if isinstance(node, (int, float)) and not isinstance(node, bool):
        return [(path, node)]
    return []


def test_smoke_run_reports_every_measurement(tmp_path):
    out = tmp_path / "report.json"
    report = bench.main(["--device", "cpu", "--tiny", "--store-dir", str(tmp_path), "--json", str(out)])
    assert json.loads(out.read_text()) == report
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]  # the adapter store is removed
    plan = bench.PLANS["tiny"]

    windows = report["no_stall"]
    assert set(windows) == {"a_no_loads", "b_async_loads", "a_sync_no_loads", "c_sync_loads"}
    for case, window in windows.items():
        assert window["arrivals"] == round(plan.window_s / plan.interval_s)
        assert window["tpot_p50_ms"] <= window["tpot_p99_ms"]
        # Windows (a) load nothing; (b) and (c) read new adapters from disk while the streams run.
        assert (window["counts"]["disk_loads"] > 0) == (case in ("b_async_loads", "c_sync_loads")), (case, window)

    rows = report["cold_ttft"]
    assert len(rows) == plan.lengths and all(2 <= row["length"] <= plan.max_length for row in rows)

    capacity = report["capacity"]
    assert {(row["rank"], row["adapter"].split("-")[1]) for row in capacity} == {
        (rank, targets) for rank in bench.RANKS for targets in ("qkvo", "all7")}
    for row in capacity:  # an adapter occupies at least its own bytes; a max-rank one on every target fills a slot
        assert row["true_bytes"] <= row["gpu_bytes"], row
        assert (row["true_bytes"] == row["padded_slot_bytes"]) == (row["adapter"] == "r128-all7"), row
    assert set(report["transfer"]) == {"disk_to_host_warm", "disk_to_host_dropped", "host_to_gpu"}

    assert set(report["ratios"]) >= set(bench.TARGETS)
    figures = _figures({k: report[k] for k in ("no_stall", "cold_ttft", "capacity", "transfer", "ratios", "tiers")})
    assert len(figures) > 50
    counts = [(path, value) for path, value in figures if path.endswith("compactions")]  # may be none
    assert all(value >= 0 for _, value in counts)
    measured = [figure for figure in figures if figure not in counts]
    assert all(math.isfinite(value) and value > 0 for _, value in measured), [f for f in measured if not f[1] > 0]


def test_adapter_files_are_what_peft_saves(tmp_path):
    shape = LlamaShape(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                       max_position_embeddings=256)
    base = build_llama(tmp_path / "base", shape=shape)
    theirs = build_lora_adapter(base, tmp_path / "peft", DemoAdapterSpec("peft", 8, 16.0, ALL_SEVEN, 1))
    store = AdapterStore(tmp_path / "store", AutoConfig.from_pretrained(base), "base", torch.float32,
                         torch.device("cpu"))
    ours = store.new(AdapterShape(8, ALL_SEVEN))

    expected = {name: tensor.shape for name, tensor in load_file(theirs / WEIGHTS_FILE).items()}
    tensors = load_file(ours.files[1])
    assert {name: tensor.shape for name, tensor in tensors.items()} == expected
    assert ours.true_bytes == sum(t.numel() * t.element_size() for t in tensors.values())
    config = LoraConfig.from_pretrained(ours.ref.storage_path)
    assert (config.r, set(config.target_modules), config.peft_type.value) == (8, set(ALL_SEVEN), "LORA")
    assert ours.ref.sha256 == directory_digest(Path(ours.ref.storage_path))

    again = store.new(ours.shape)  # the same weights (one file, linked), yet another adapter version
    assert again.files[1].samefile(ours.files[1]) and again.ref.sha256 != ours.ref.sha256
    assert again.ref.sha256 == directory_digest(Path(again.ref.storage_path))
