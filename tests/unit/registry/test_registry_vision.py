"""A LLaVA base model registers by its language model; adapters on that language model register
(PEFT's regex target_modules included), and so do adapters on the vision tower too (tower_lora_params;
test_registry_tower_lora.py has the rest)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from registry.base_model_files import read_base_model_spec
from registry.store import RegistryStore
from services.demo_assets import (DEMO_VISION_ADAPTERS, ClipShape, LlamaShape, build_llava,
                                  build_lora_adapter)
from services.common.errors import InvalidArgument

TEXT = LlamaShape(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                  max_position_embeddings=256)


@pytest.fixture(scope="module")
def llava_dirs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """llava/ (a tiny LLaVA-1.5), lm-adapter/ (its language model's q/k/v/o), vision-adapter/ (bare
    "q_proj", "v_proj": PEFT adapts the CLIP tower's projections as well)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    root = tmp_path_factory.mktemp("llava")
    base = build_llava(root / "llava", tokenizer_dir=None, text=TEXT,
                       vision=ClipShape(image_size=32, patch_size=8, hidden_size=32))
    build_lora_adapter(base, root / "lm-adapter", DEMO_VISION_ADAPTERS[0])
    model = AutoModelForImageTextToText.from_pretrained(base, dtype=torch.float32)
    get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])).save_pretrained(
        root / "vision-adapter")
    return root


@pytest.fixture
def llava_store(store: RegistryStore, imports: Path, llava_dirs: Path) -> RegistryStore:
    for name in ("llava", "lm-adapter", "vision-adapter"):
        shutil.copytree(llava_dirs / name, imports / name)
    store.register_base_model("tiny-llava", str(imports / "llava"))
    return store


def test_llava_registers_by_its_language_model(llava_store: RegistryStore) -> None:
    base = llava_store.get_base_model("tiny-llava")
    assert (base.architecture, base.num_layers, base.hidden_size, base.max_context) == (
        "LlavaForConditionalGeneration", 2, 64, 256)
    assert (base.module_shapes["k_proj"].in_features, base.module_shapes["k_proj"].out_features) == (64, 32)


def test_language_model_adapter_registers(llava_store: RegistryStore, imports: Path) -> None:
    record = llava_store.register_adapter("lm", "tiny-llava", str(imports / "lm-adapter"))
    assert json.loads((imports / "lm-adapter" / "adapter_config.json").read_text())["target_modules"].startswith(".*")
    assert record.target_modules == ("q_proj", "k_proj", "v_proj", "o_proj") and record.rank == 8


def test_bare_target_names_register_with_their_tower_lora(llava_store: RegistryStore, imports: Path) -> None:
    """Bare "q_proj", "v_proj" adapt CLIP's q/v too: r 4 x (32 + 32) on 2 layers x 2 projections."""
    record = llava_store.register_adapter("vision", "tiny-llava", str(imports / "vision-adapter"))
    assert record.target_modules == ("q_proj", "v_proj") and record.tower_lora_params == 4 * 64 * 2 * 2


def test_text_adapter_does_not_fit_llava(llava_store: RegistryStore, imports: Path) -> None:
    """A Llama adapter's tensor names lack LLaVA's language_model level."""
    with pytest.raises(InvalidArgument, match="language_model.layers.0"):
        llava_store.register_adapter("text", "tiny-llava", str(imports / "attn-qv"))


def test_sparse_text_config_takes_llama_defaults(tmp_path: Path) -> None:
    """llava-hf's LLaVA-1.5-7B config.json names only what differs from LlamaConfig's defaults."""
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlavaForConditionalGeneration"], "model_type": "llava",
        "text_config": {"model_type": "llama", "max_position_embeddings": 4096, "vocab_size": 32064}}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    spec = read_base_model_spec(tmp_path)
    assert (spec.hidden_size, spec.num_layers, spec.max_context, spec.vocab_size) == (4096, 32, 4096, 32064)
    assert spec.module_shapes["down_proj"].in_features == 11008
