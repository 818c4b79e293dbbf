"""Tower LoRA at registration: tensors on LLaVA's vision tower and projector are checked against the base
model's config.json and counted (tower_lora_params); a wrong shape, an unserved module or an A without its
B is a 400 naming the tensor; a text model has no tower, so such tensors stay refused."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from registry.store import RegistryStore
from services.common.errors import InvalidArgument
from tests.unit.registry.test_registry_vision import llava_dirs  # noqa: F401 (the tiny LLaVA and its adapters)

CLIP_Q = "base_model.model.model.vision_tower.encoder.layers.0.self_attn.q_proj.lora_A.weight"


@pytest.fixture
def tower_store(store: RegistryStore, imports: Path, llava_dirs: Path) -> RegistryStore:  # noqa: F811
    shutil.copytree(llava_dirs / "llava", imports / "llava")
    store.register_base_model("tiny-llava", str(imports / "llava"))
    return store


def _edited(llava_dirs: Path, imports: Path, name: str, edit) -> str:  # noqa: F811
    """A copy of the bare-name adapter (q_proj, v_proj: CLIP's too) with its tensors edited."""
    directory = imports / name
    shutil.copytree(llava_dirs / "vision-adapter", directory)
    tensors = load_file(directory / "adapter_model.safetensors")
    edit(tensors)
    save_file(tensors, directory / "adapter_model.safetensors")
    return str(directory)


def test_tower_adapter_registers_with_its_parameter_count(tower_store, imports, llava_dirs):  # noqa: F811
    record = tower_store.register_adapter("qv", "tiny-llava", _edited(llava_dirs, imports, "qv", lambda t: None))
    assert record.tower_lora_params == 2 * 2 * 4 * (32 + 32)
    assert tower_store.get_adapter("qv").tower_lora_params == record.tower_lora_params


def test_wrong_tower_shape_is_refused_naming_the_tensor(tower_store, imports, llava_dirs):  # noqa: F811
    def widen(tensors):
        tensors[CLIP_Q] = torch.zeros(4, 31)
    with pytest.raises(InvalidArgument, match=r"q_proj\.lora_A\.weight' has shape \[4, 31\]; expected \[4, 32\]"):
        tower_store.register_adapter("bad", "tiny-llava", _edited(llava_dirs, imports, "bad", widen))


def test_rank_mismatch_on_the_tower_is_refused(tower_store, imports, llava_dirs):  # noqa: F811
    def rank8(tensors):
        tensors[CLIP_Q] = torch.zeros(8, 32)
    with pytest.raises(InvalidArgument, match="rank mismatch: the config says r=4"):
        tower_store.register_adapter("bad", "tiny-llava", _edited(llava_dirs, imports, "bad", rank8))


def test_unserved_tower_module_is_refused_naming_the_tensor(tower_store, imports, llava_dirs):  # noqa: F811
    name = "base_model.model.model.vision_tower.embeddings.patch_embedding.lora_A.weight"

    def conv(tensors):
        tensors[name] = torch.zeros(4, 3)
    with pytest.raises(InvalidArgument, match=r"patch_embedding\.lora_A\.weight' adapts a vision module"):
        tower_store.register_adapter("bad", "tiny-llava", _edited(llava_dirs, imports, "bad", conv))


def test_a_without_b_is_refused(tower_store, imports, llava_dirs):  # noqa: F811
    def drop_b(tensors):
        del tensors[CLIP_Q.replace("lora_A", "lora_B")]
    with pytest.raises(InvalidArgument, match="has a lora_A but no"):
        tower_store.register_adapter("bad", "tiny-llava", _edited(llava_dirs, imports, "bad", drop_b))
    assert tower_store.list_adapters(base_model="tiny-llava") == []
