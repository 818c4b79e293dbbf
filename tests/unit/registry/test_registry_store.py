import hashlib
import json
import shutil
from pathlib import Path

import pytest

from registry.records import ModuleShape, ReportedPlacement, Tier
from registry.store import RegistryStore
from registry.store_lock import LOCK_FILE
from services.common.errors import (
    AlreadyExists,
    InvalidArgument,
    NotFound,
    PermissionDenied,
)

from .conftest import BASE_MODEL, FakeClock

P = ReportedPlacement  # short, for the placement lists below


def test_base_model_spec_from_config(store: RegistryStore, imports: Path) -> None:
    base = store.get_base_model(BASE_MODEL)
    assert (base.architecture, base.num_layers, base.hidden_size, base.vocab_size, base.max_context) == (
        "LlamaForCausalLM", 2, 64, 128, 256)
    # 4 heads x head_dim 16 = 64 for q; 2 kv heads x 16 = 32 for k/v.
    assert base.module_shapes["q_proj"] == ModuleShape(64, 64)
    assert base.module_shapes["k_proj"] == ModuleShape(64, 32)
    assert base.module_shapes["down_proj"] == ModuleShape(128, 64)
    assert base.path == str(imports / "base")
    assert [b.name for b in store.list_base_models()] == [BASE_MODEL]
    with pytest.raises(AlreadyExists):
        store.register_base_model(BASE_MODEL, str(imports / "base"))


def test_base_model_refuses_unsupported_architecture(store: RegistryStore, imports: Path) -> None:
    config_path = imports / "base" / "config.json"
    config = json.loads(config_path.read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    config_path.write_text(json.dumps(config))
    with pytest.raises(InvalidArgument, match="GPT2LMHeadModel"):
        store.register_base_model("other", str(imports / "base"))


def test_adapter_is_stored_by_content_and_verified(store: RegistryStore, imports: Path, tmp_path: Path) -> None:
    record = store.register_adapter("a1", BASE_MODEL, str(imports / "all-proj"))
    source = (imports / "all-proj" / "adapter_model.safetensors").read_bytes()
    config = (imports / "all-proj" / "adapter_config.json").read_bytes()
    # The content address covers both files: the sha256 of a manifest of their sha256 (common.proto).
    manifest = (f"tessera-adapter-v1\nadapter_config.json {hashlib.sha256(config).hexdigest()}\n"
                f"adapter_model.safetensors {hashlib.sha256(source).hexdigest()}\n")
    assert record.sha256 == hashlib.sha256(manifest.encode()).hexdigest()
    assert record.size_bytes == len(source)
    assert (record.rank, record.alpha) == (4, 8.0)
    assert record.target_modules == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    stored = Path(record.storage_path)
    assert stored == tmp_path / "store" / record.sha256
    assert sorted(p.name for p in stored.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert (stored / "adapter_model.safetensors").read_bytes() == source
    assert (stored / "adapter_config.json").read_bytes() == config
    assert store.get_adapter("a1") == record
    assert record.task_head is None  # plain LoRA: no head in its files
    # No staging leftovers.
    assert sorted(p.name for p in (tmp_path / "store").iterdir()) == sorted([LOCK_FILE, record.sha256])


def test_identical_weights_share_one_blob_until_the_last_is_deleted(store: RegistryStore, imports: Path,
                                                                    clock: FakeClock) -> None:
    shutil.copytree(imports / "all-proj", imports / "copy")
    first = store.register_adapter("a1", BASE_MODEL, str(imports / "all-proj"))
    second = store.register_adapter("a2", BASE_MODEL, str(imports / "copy"))
    assert first.storage_path == second.storage_path
    store.delete_adapter("a1")
    clock.now += 3600
    assert store.sweep_deleted_files() == [] and Path(second.storage_path).is_dir()  # a2 still uses it
    store.delete_adapter("a2")
    clock.now += 600  # the default grace
    assert store.sweep_deleted_files() == [Path(second.storage_path)] and not Path(second.storage_path).exists()
    assert store.list_adapters() == []


def test_identical_weights_with_another_alpha_are_stored_apart(store: RegistryStore, imports: Path,
                                                               clock: FakeClock) -> None:
    shutil.copytree(imports / "all-proj", imports / "copy")
    config_path = imports / "copy" / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config["lora_alpha"] = 32
    config_path.write_text(json.dumps(config))
    first = store.register_adapter("a1", BASE_MODEL, str(imports / "all-proj"))
    second = store.register_adapter("a2", BASE_MODEL, str(imports / "copy"))
    assert (first.alpha, second.alpha) == (8.0, 32.0)
    assert first.sha256 != second.sha256 and first.storage_path != second.storage_path
    assert json.loads((Path(second.storage_path) / "adapter_config.json").read_text())["lora_alpha"] == 32
    store.delete_adapter("a2")
    clock.now += 600
    store.sweep_deleted_files()
    assert Path(first.storage_path).is_dir() and not Path(second.storage_path).exists()


def test_adapter_errors(store: RegistryStore, imports: Path, tmp_path: Path) -> None:
    store.register_adapter("a1", BASE_MODEL, str(imports / "attn-qv"))
    with pytest.raises(AlreadyExists):
        store.register_adapter("a1", BASE_MODEL, str(imports / "all-proj"))
    with pytest.raises(NotFound):
        store.register_adapter("a2", "no-such-base", str(imports / "all-proj"))
    with pytest.raises(NotFound):
        store.get_adapter("missing")
    with pytest.raises(NotFound):
        store.delete_adapter("missing")
    with pytest.raises(InvalidArgument, match="name"):
        store.register_adapter("../evil", BASE_MODEL, str(imports / "all-proj"))
    with pytest.raises(InvalidArgument, match="absolute"):
        store.register_adapter("a3", BASE_MODEL, "imports/all-proj")
    outside = tmp_path / "outside"
    shutil.copytree(imports / "all-proj", outside)
    with pytest.raises(PermissionDenied, match="outside the allowed import roots"):
        store.register_adapter("a3", BASE_MODEL, str(outside))
    assert [a.name for a in store.list_adapters(base_model=BASE_MODEL)] == ["a1"]
    assert store.list_adapters(base_model="other") == []


def test_workers_heartbeat_health_and_reregistration(store: RegistryStore, clock: FakeClock) -> None:
    worker = store.register_worker("127.0.0.1:7001", "cpu", BASE_MODEL, capacity=8)
    other = store.register_worker("127.0.0.1:7002", "cuda:0", "other-base", capacity=4)
    assert worker.healthy and worker.stats == {}
    clock.now += 5
    assert store.heartbeat(worker.worker_id, {"running_requests": 3})
    assert not store.heartbeat("unknown-id", {})
    clock.now += 6  # worker beat 6 s ago, other 11 s ago (timeout 10 s)
    assert [w.address for w in store.list_workers(healthy_only=True)] == ["127.0.0.1:7001"]
    listed = {w.address: w for w in store.list_workers()}
    assert not listed["127.0.0.1:7002"].healthy
    assert listed["127.0.0.1:7001"].stats == {"running_requests": 3}
    assert [w.worker_id for w in store.list_workers(base_model="other-base")] == [other.worker_id]

    restarted = store.register_worker("127.0.0.1:7001", "cpu", BASE_MODEL, capacity=8)
    assert restarted.worker_id != worker.worker_id
    assert not store.heartbeat(worker.worker_id, {})
    assert len(store.list_workers()) == 2
    with pytest.raises(InvalidArgument):
        store.register_worker("127.0.0.1:7003", "cpu", BASE_MODEL, capacity=0)


def test_workers_silent_past_their_expiry_are_forgotten_with_their_placements(store: RegistryStore, imports: Path,
                                                                             clock: FakeClock) -> None:
    """Default expiry 3,600 s: a worker gone for good (killed, scaled in) leaves /admin/v1/workers then."""
    store.register_adapter("a1", BASE_MODEL, str(imports / "all-proj"))
    gone = store.register_worker("127.0.0.1:7001", "cpu", BASE_MODEL, capacity=8)
    live = store.register_worker("127.0.0.1:7002", "cpu", BASE_MODEL, capacity=8)
    store.replace_placements(gone.worker_id, [P("a1", Tier.GPU)])
    clock.now += 3000
    assert store.heartbeat(live.worker_id, {}) and store.expire_workers() == []  # unhealthy, not yet forgotten
    assert not {w.address: w for w in store.list_workers()}["127.0.0.1:7001"].healthy
    clock.now += 601

    assert [w.worker_id for w in store.expire_workers()] == [gone.worker_id]
    assert [w.worker_id for w in store.list_workers()] == [live.worker_id]
    assert store.list_placements(adapter="a1") == []
    assert not store.heartbeat(gone.worker_id, {}), "come back: register again"


def test_placements_replace_and_follow_deletes(store: RegistryStore, imports: Path) -> None:
    store.register_adapter("a1", BASE_MODEL, str(imports / "all-proj"))
    store.register_adapter("a2", BASE_MODEL, str(imports / "attn-qv"))
    w1 = store.register_worker("127.0.0.1:7001", "cpu", BASE_MODEL, capacity=8).worker_id
    w2 = store.register_worker("127.0.0.1:7002", "cpu", BASE_MODEL, capacity=8).worker_id
    # a1 reported twice keeps its fastest tier; an adapter unknown to the registry is skipped.
    stored = store.replace_placements(w1, [P("a1", Tier.HOST), P("a1", Tier.GPU, pinned=True),
                                           P("a2", Tier.DISK, loading=True), P("gone", Tier.GPU)])
    assert [(p.adapter, p.tier, p.loading, p.pinned) for p in stored] == [
        ("a1", Tier.GPU, False, True), ("a2", Tier.DISK, True, False)]
    assert store.list_placements(worker_id=w1) == stored
    store.replace_placements(w2, [P("a1", Tier.HOST)])
    assert {(p.worker_id, p.tier) for p in store.list_placements(adapter="a1")} == {(w1, Tier.GPU), (w2, Tier.HOST)}

    store.replace_placements(w1, [P("a2", Tier.GPU)])  # replaces, never merges
    assert [(p.adapter, p.tier) for p in store.list_placements(worker_id=w1)] == [("a2", Tier.GPU)]
    store.delete_adapter("a2")
    assert store.list_placements(worker_id=w1) == []
    store.register_worker("127.0.0.1:7002", "cpu", BASE_MODEL, capacity=8)  # restart drops w2's placements
    assert store.list_placements() == []
    with pytest.raises(NotFound):
        store.replace_placements(w2, [])


def test_adapter_and_base_model_names_never_clash(store: RegistryStore, imports: Path) -> None:
    """Requests name a base model or an adapter in one `model` field: a name means one thing."""
    with pytest.raises(AlreadyExists, match=f"{BASE_MODEL!r} is already a base model's name"):
        store.register_adapter(BASE_MODEL, BASE_MODEL, str(imports / "attn-qv"))
    store.register_adapter("qv", BASE_MODEL, str(imports / "attn-qv"))
    with pytest.raises(AlreadyExists, match="'qv' is already an adapter's name"):
        store.register_base_model("qv", str(imports / "base"))
    assert [b.name for b in store.list_base_models()] == [BASE_MODEL]
    assert [a.name for a in store.list_adapters()] == ["qv"]


@pytest.mark.parametrize("stored_file", ["adapter_config.json", "adapter_model.safetensors"])
def test_a_damaged_stored_copy_is_replaced_by_the_next_import_of_the_same_files(
        store: RegistryStore, imports: Path, stored_file: str) -> None:
    first = store.register_adapter("a1", BASE_MODEL, str(imports / "attn-qv"))
    damaged = Path(first.storage_path) / stored_file
    damaged.write_bytes(damaged.read_bytes()[:-1])
    second = store.register_adapter("a2", BASE_MODEL, str(imports / "attn-qv"))
    assert second.storage_path == first.storage_path
    assert (Path(second.storage_path) / stored_file).read_bytes() == (imports / "attn-qv" / stored_file).read_bytes()
