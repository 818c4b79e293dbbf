"""The loader's safety checks (the adapter manager's tiers: test_adapter_manager.py)."""

from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
from pathlib import Path

import pytest

from gpu_worker.lora.loader import load_adapter
from gpu_worker.models.llama import LORA_TARGETS
from services.common.adapter_layout import TEXT_LAYOUT, directory_digest
from services.common.errors import FailedPrecondition, InvalidArgument, PermissionDenied

from .conftest import TINY_LLAMA


def _load(ref, store):
    return load_adapter(ref, store, TEXT_LAYOUT, LORA_TARGETS, num_layers=2, hidden_size=TINY_LLAMA.hidden_size)


def test_loads_peft_names_with_scaling(tiny_assets):
    weights = _load(tiny_assets.adapters["demo-r16"], tiny_assets.store)
    assert weights.rank == 16 and {module.scaling for module in weights.modules.values()} == {2.0}
    assert sorted({target for _, target in weights.modules}) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    a, b, _ = weights.modules[(1, "o_proj")]
    assert a.shape == (16, 64) and b.shape == (64, 16)


def test_wrong_digest_is_refused(tiny_assets):
    ref = dataclasses.replace(tiny_assets.adapters["demo-r8"], sha256="0" * 64)
    with pytest.raises(FailedPrecondition, match="checksum mismatch"):
        _load(ref, tiny_assets.store)


@pytest.fixture
def stored_copy(tiny_assets):
    """A copy of demo-r8's stored directory (inside the store), and its registry record: tests damage it."""
    directory = Path(tempfile.mkdtemp(prefix="copy-", dir=tiny_assets.store))
    shutil.copytree(tiny_assets.adapters["demo-r8"].storage_path, directory, dirs_exist_ok=True)
    yield directory, dataclasses.replace(tiny_assets.adapters["demo-r8"], storage_path=str(directory))
    shutil.rmtree(directory)


def _set_alpha(directory: Path, alpha: float) -> None:
    path = directory / "adapter_config.json"
    config = json.loads(path.read_text())
    config["lora_alpha"] = alpha
    path.write_text(json.dumps(config))


def _flip_last_weight_byte(directory: Path) -> None:
    path = directory / "adapter_model.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


def _truncate_config(directory: Path) -> None:
    path = directory / "adapter_config.json"
    path.write_bytes(path.read_bytes()[:20])


@pytest.mark.parametrize("tamper", [_truncate_config, lambda d: _set_alpha(d, 3200), _flip_last_weight_byte],
                         ids=["config-truncated", "alpha-32-to-3200", "weights-one-bit"])
def test_a_stored_file_changed_after_registration_fails_the_checksum(stored_copy, tiny_assets, tamper):
    directory, ref = stored_copy
    assert _load(ref, tiny_assets.store).rank == 8  # intact: loads
    tamper(directory)
    with pytest.raises(FailedPrecondition, match="checksum mismatch"):
        _load(ref, tiny_assets.store)


@pytest.mark.parametrize("config_text, message", [
    ('{"peft_type": "LORA", "r": 8, "lora_alpha": NaN}', "NaN is not allowed"),
    ('{"peft_type": "LORA", "r": 8, "lora_alpha": 1e999}', "1e999 overflows"),
    ('{"peft_type": "LORA", "r": 8, "lora_alpha": 1e308}', "lora_alpha must be a finite number in"),
    ('{"peft_type": "LORA", "r": 8, "lora_alpha": 16, "x": ' + "[" * 5000 + "]" * 5000 + "}", "deeper than"),
    ('{"peft_type": "LORA", "r": 4, "lora_alpha": 16}', "says r=4 for model.layers.0.self_attn.q_proj but"),
    ('{"peft_type": "LORA", "r": 8, "lora_alpha": 16, "rank_pattern": {"v_proj": 2}}', "says r=2 for model.layers.0"),
    ('{"peft_type": "LORA", "r": 8, "lora_alpha": 16, "use_dora": true}', "use_dora \\(DoRA\\) is not supported"),
    ('{"peft_type": "LORA", "r": 8, "lora_alpha": 16, "alpha_pattern": {"(q|v)+": 4}}', "repeats a group"),
])
def test_a_recorded_but_unservable_config_is_refused_at_load(stored_copy, tiny_assets, config_text, message):
    """A record whose digest covers a bad config (written by hand, or by an older registry) still fails cleanly."""
    directory, ref = stored_copy
    (directory / "adapter_config.json").write_text(config_text)
    ref = dataclasses.replace(ref, sha256=directory_digest(directory))
    with pytest.raises(InvalidArgument, match=message):
        _load(ref, tiny_assets.store)


def test_tensors_are_those_safetensors_reads(tiny_assets):
    """The loader lays tensors over the verified bytes itself: the same names, dtypes and values."""
    import torch
    from safetensors.torch import load_file
    ref = tiny_assets.adapters["demo-r16"]
    weights = _load(ref, tiny_assets.store)
    expected = load_file(Path(ref.storage_path) / "adapter_model.safetensors")
    assert len(expected) == 2 * len(weights.modules)
    for (layer, target), module in weights.modules.items():
        prefix = f"base_model.model.model.layers.{layer}.self_attn.{target}"
        for which, tensor in (("A", module.a), ("B", module.b)):
            reference = expected[f"{prefix}.lora_{which}.weight"]
            assert tensor.dtype == reference.dtype and torch.equal(tensor, reference)


@pytest.mark.parametrize("damage, message", [
    (lambda data: data[:8] + b"{not json" + data[8 + 9:], "corrupt header"),
    (lambda data: (10**6).to_bytes(8, "little") + data[8:], "truncated"),
    (lambda data: data[:-2], "truncated"),
], ids=["header-not-json", "header-longer-than-file", "data-truncated"])
def test_a_recorded_but_corrupt_weights_file_is_refused_at_load(stored_copy, tiny_assets, damage, message):
    """A digest that covers a corrupt safetensors file (not checked at registration by an older registry)."""
    directory, ref = stored_copy
    path = directory / "adapter_model.safetensors"
    path.write_bytes(damage(path.read_bytes()))
    ref = dataclasses.replace(ref, sha256=directory_digest(directory))
    with pytest.raises(InvalidArgument, match=message):
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
