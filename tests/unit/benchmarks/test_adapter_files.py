"""benchmarks/harness/adapter_files.py: the benchmarks' adapter files against what PEFT itself saves
for the same model, each a new adapter version to the worker."""

from __future__ import annotations

from pathlib import Path

import torch
from peft import LoraConfig
from safetensors.torch import load_file
from transformers import AutoConfig

from benchmarks.harness.adapter_files import AdapterShape, AdapterStore
from benchmarks.harness.shapes import ALL_SEVEN
from services.common.adapter_layout import WEIGHTS_FILE, directory_digest
from services.demo_assets import DemoAdapterSpec, LlamaShape, build_llama, build_lora_adapter


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
