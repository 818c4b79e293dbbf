"""The loader's safety checks and the adapter pool's slots (policy eviction, waiting when pinned)."""

from __future__ import annotations

import dataclasses
import shutil

import pytest

from gpu_worker.lora.adapter_pool import AdapterPool
from gpu_worker.lora.loader import AdapterRef, LoRAWeights, load_adapter
from gpu_worker.models.llama import LORA_TARGETS
from services.common.adapter_layout import TEXT_LAYOUT
from services.common.errors import FailedPrecondition, PermissionDenied
from services.common.scheduling.eviction import LRU, LFUDecay


def _load(ref, store):
    return load_adapter(ref, store, TEXT_LAYOUT, LORA_TARGETS, num_layers=2)


def test_loads_peft_names_with_scaling(tiny_assets):
    weights = _load(tiny_assets.adapters["demo-r16"], tiny_assets.store)
    assert weights.rank == 16 and weights.scaling == 2.0
    assert sorted({target for _, target in weights.modules}) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    a, b = weights.modules[(1, "o_proj")]
    assert a.shape == (16, 64) and b.shape == (64, 16)


def test_wrong_sha256_is_refused(tiny_assets):
    ref = dataclasses.replace(tiny_assets.adapters["demo-r8"], sha256="0" * 64)
    with pytest.raises(FailedPrecondition, match="sha256"):
        _load(ref, tiny_assets.store)


def test_directory_outside_the_store_is_refused(tiny_assets, tmp_path):
    outside = tmp_path / "evil"
    shutil.copytree(tiny_assets.adapters["demo-r8"].storage_path, outside)
    with pytest.raises(PermissionDenied, match="outside the adapter store"):
        _load(dataclasses.replace(tiny_assets.adapters["demo-r8"], storage_path=str(outside)), tiny_assets.store)
    sneaky = f"{tiny_assets.store}/../evil"  # resolves outside too
    with pytest.raises(PermissionDenied):
        _load(dataclasses.replace(tiny_assets.adapters["demo-r8"], storage_path=sneaky), tiny_assets.store)


def test_pickle_is_never_loaded(tiny_assets, monkeypatch):
    import torch
    directory = tiny_assets.store / "pickled"
    directory.mkdir()
    shutil.copy(f"{tiny_assets.adapters['demo-r8'].storage_path}/adapter_config.json", directory)
    (directory / "adapter_model.bin").write_bytes(b"not even a pickle")
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load was called"))
    ref = dataclasses.replace(tiny_assets.adapters["demo-r8"], storage_path=str(directory))
    with pytest.raises(FailedPrecondition, match="never loaded"):
        _load(ref, tiny_assets.store)


class _Layer:
    def __init__(self):
        self.slots = {}

    def set_slot(self, slot, slices, scaling):
        self.slots[slot] = slices[0][0]

    def reset_slot(self, slot):
        self.slots.pop(slot, None)


def _ref(name):
    return AdapterRef(name, "m", 4, "", "")


def test_pool_evicts_lru_and_waits_when_all_pinned():
    layer = _Layer()
    loads = []

    def load(ref):
        loads.append(ref.name)
        return LoRAWeights(ref.name, 4, 1.0, {(0, "q_proj"): (ref.name, None)})

    pool = AdapterPool({(0, "q_proj"): (layer, 0)}, num_slots=2, load=load)
    slot_a, slot_b = pool.acquire(_ref("a")), pool.acquire(_ref("b"))
    assert pool.acquire(_ref("c")) is None            # both pinned: c waits
    pool.release("a")
    pool.release("b")
    assert pool.acquire(_ref("b")) == slot_b          # resident: no reload
    assert pool.acquire(_ref("c")) == slot_a          # evicts a, the least recently used
    assert pool.resident() == ["b", "c"] and layer.slots[slot_a] == "c"
    assert loads == ["a", "b", "c"]


def _pool(num_slots, eviction=LRU()):
    return AdapterPool({(0, "q_proj"): (_Layer(), 0)}, num_slots, load=lambda ref: LoRAWeights(
        ref.name, 4, 1.0, {(0, "q_proj"): (ref.name, None)}), eviction=eviction)


def _use(pool, name):
    slot = pool.acquire(_ref(name))
    pool.release(name)
    return slot


def test_pool_evicts_the_adapter_released_longest_ago_not_the_one_acquired_first():
    pool = _pool(2)
    pool.acquire(_ref("a"))
    slot_b = pool.acquire(_ref("b"))
    pool.release("b")
    pool.release("a")                                 # a was acquired first but released last
    assert pool.acquire(_ref("c")) == slot_b
    assert pool.resident() == ["a", "c"]


def test_pool_with_lfu_decay_keeps_the_frequently_used_adapter():
    pool = _pool(2, LFUDecay(half_life_s=100.0))      # the pool's clock counts releases
    for _ in range(3):
        _use(pool, "hot")
    _use(pool, "cold")                                # released last: LRU would evict hot
    _use(pool, "new")
    assert pool.resident() == ["hot", "new"]
