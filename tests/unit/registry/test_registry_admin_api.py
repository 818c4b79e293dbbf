import json
import os
import pickle
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
from flask.testing import FlaskClient

from registry.app import create_admin_app
from registry.records import ReportedPlacement, Tier
from registry.store import RegistryStore
from registry.store_lock import LOCK_FILE

from .conftest import BASE_MODEL

API_KEY = "test-admin-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture
def client(store: RegistryStore) -> FlaskClient:
    return create_admin_app(store, API_KEY).test_client()


def register(client: FlaskClient, name: str, path: Path, **extra: object):  # type: ignore[no-untyped-def]
    return client.post("/admin/v1/adapters", headers=AUTH,
                       json={"name": name, "base_model": BASE_MODEL, "path": str(path), **extra})


def error_of(response) -> dict:  # type: ignore[no-untyped-def]
    body = response.get_json()
    assert set(body) == {"error"} and body["error"]["code"] == response.status_code
    return body["error"]


def test_register_list_show_delete(client: FlaskClient, imports: Path, store: RegistryStore, clock) -> None:
    created = register(client, "support-bot", imports / "seq-cls")
    assert created.status_code == 201
    record = created.get_json()
    assert record["name"] == "support-bot" and record["rank"] == 4
    # Its head comes from its files (test_task_head_adapters.py): PEFT's score head over 3 labels.
    assert (record["task_head"]["kind"], record["task_head"]["labels"]) == (
        "classifier", ["negative", "neutral", "positive"])
    assert register(client, "qv", imports / "attn-qv").status_code == 201

    listed = client.get(f"/admin/v1/adapters?base_model={BASE_MODEL}", headers=AUTH).get_json()["adapters"]
    assert [a["name"] for a in listed] == ["qv", "support-bot"]
    shown = client.get("/admin/v1/adapters/support-bot", headers={"X-API-Key": API_KEY})
    assert shown.status_code == 200 and shown.get_json() == record
    base_models = client.get("/admin/v1/base-models", headers=AUTH).get_json()["base_models"]
    assert [b["name"] for b in base_models] == [BASE_MODEL]

    assert client.delete("/admin/v1/adapters/support-bot", headers=AUTH).status_code == 200
    assert client.get("/admin/v1/adapters/support-bot", headers=AUTH).status_code == 404
    # Its files stay through the grace (a worker may still read them for requests it took before),
    # then the sweep removes them; the other adapter's stay.
    stored = Path(record["storage_path"])
    clock.now += 599
    assert store.sweep_deleted_files() == [] and stored.is_dir()
    clock.now += 1
    assert store.sweep_deleted_files() == [stored] and not stored.exists()
    assert Path(shown_qv(client)["storage_path"]).is_dir()


def shown_qv(client: FlaskClient) -> dict:
    return client.get("/admin/v1/adapters/qv", headers=AUTH).get_json()


def test_an_adapter_registered_again_within_the_grace_keeps_its_files(client: FlaskClient, imports: Path,
                                                                      store: RegistryStore, clock) -> None:
    first = register(client, "bot", imports / "all-proj").get_json()
    assert client.delete("/admin/v1/adapters/bot", headers=AUTH).status_code == 200
    again = register(client, "bot-again", imports / "all-proj").get_json()
    assert again["storage_path"] == first["storage_path"]  # the same content: the same directory
    clock.now += 3600
    assert store.sweep_deleted_files() == [] and Path(again["storage_path"]).is_dir()


def test_base_model_registration(client: FlaskClient, imports: Path) -> None:
    created = client.post("/admin/v1/base-models", headers=AUTH, json={"name": "second", "path": str(imports / "base")})
    assert created.status_code == 201 and created.get_json()["architecture"] == "LlamaForCausalLM"
    again = client.post("/admin/v1/base-models", headers=AUTH, json={"name": "second", "path": str(imports / "base")})
    assert again.status_code == 409


def test_workers_and_placements_listing(client: FlaskClient, store: RegistryStore, imports: Path) -> None:
    register(client, "a1", imports / "attn-qv")
    worker = store.register_worker("127.0.0.1:7001", "cpu", BASE_MODEL, capacity=4)
    store.replace_placements(worker.worker_id, [ReportedPlacement("a1", Tier.GPU, loading=False, pinned=True)])
    workers = client.get("/admin/v1/workers?healthy_only=true", headers=AUTH).get_json()["workers"]
    assert [(w["worker_id"], w["healthy"]) for w in workers] == [(worker.worker_id, True)]
    placements = client.get("/admin/v1/placements?adapter=a1", headers=AUTH).get_json()["placements"]
    assert [(p["worker_id"], p["tier"], p["loading"], p["pinned"]) for p in placements] == [
        (worker.worker_id, "gpu", False, True)]


def test_api_key_is_required(client: FlaskClient) -> None:
    assert client.get("/healthz").status_code == 200
    missing = client.get("/admin/v1/adapters")
    assert missing.status_code == 401 and "missing admin API key" in error_of(missing)["message"]
    for headers in ({"Authorization": "Bearer wrong"}, {"X-API-Key": "wrong"}):
        wrong = client.get("/admin/v1/adapters", headers=headers)
        assert wrong.status_code == 403 and error_of(wrong)["type"] == "permission_error"


@pytest.mark.parametrize("body, message", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
    (json.dumps({"name": "x", "base_model": BASE_MODEL}), "missing required field 'path'"),
    (json.dumps({"name": 7, "base_model": BASE_MODEL, "path": "/x"}), "field 'name' must be a str"),
    (json.dumps({"name": "x", "base_model": BASE_MODEL, "path": "/x", "tpot_slo_ms": "40"}),
     "field 'tpot_slo_ms' must be a int or float"),
    (json.dumps({"name": "x", "base_model": BASE_MODEL, "path": "/x", "task_head": {"classes": 3}}),
     "field 'task_head' is not accepted: an adapter's task head is read from its adapter_config.json"),
    (json.dumps({"name": "x", "base_model": BASE_MODEL, "path": "/x", "extra": 1}), "unknown field 'extra'"),
])
def test_malformed_requests_are_400(client: FlaskClient, body: str, message: str) -> None:
    response = client.post("/admin/v1/adapters", headers={**AUTH, "Content-Type": "application/json"}, data=body)
    assert response.status_code == 400 and message in error_of(response)["message"]


def test_conflicts_and_unknowns(client: FlaskClient, imports: Path) -> None:
    assert register(client, "a1", imports / "attn-qv").status_code == 201
    assert register(client, "a1", imports / "attn-qv").status_code == 409
    assert client.get("/admin/v1/adapters/nope", headers=AUTH).status_code == 404
    assert client.delete("/admin/v1/adapters/nope", headers=AUTH).status_code == 404
    unknown_base = client.post("/admin/v1/adapters", headers=AUTH,
                               json={"name": "a2", "base_model": "nope", "path": str(imports / "attn-qv")})
    assert unknown_base.status_code == 404
    assert client.get("/admin/v1/no-such-route", headers=AUTH).status_code == 404


def edit_config(key: str, value: object) -> Callable[[Path], None]:
    def mutate(adapter: Path) -> None:
        path = adapter / "adapter_config.json"
        config = json.loads(path.read_text())
        config[key] = value
        path.write_text(json.dumps(config))
    return mutate


def replace_in_config(old: str, new: str) -> Callable[[Path], None]:
    """Edit adapter_config.json as text: for what json.dumps cannot write (1e999, deep nesting)."""
    def mutate(adapter: Path) -> None:
        path = adapter / "adapter_config.json"
        text = path.read_text()
        assert old in text
        path.write_text(text.replace(old, new, 1))
    return mutate


def header_metadata(raw_json: str) -> Callable[[Path], None]:
    """Rewrite the safetensors header with `"__metadata__": <raw_json>` (the data section unchanged)."""
    def mutate(adapter: Path) -> None:
        path = adapter / "adapter_model.safetensors"
        data = path.read_bytes()
        (length,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8:8 + length])
        header["__metadata__"] = "PLACEHOLDER"
        encoded = json.dumps(header).replace('"PLACEHOLDER"', raw_json).encode()
        path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data[8 + length:])
    return mutate


DEEP = "[" * 5000 + "]" * 5000  # Python's json raises RecursionError on it


def truncate(adapter: Path) -> None:
    path = adapter / "adapter_model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:-100])


def corrupt_header(adapter: Path) -> None:
    path = adapter / "adapter_model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:12] = b"\xff\xfe{["
    path.write_bytes(bytes(data))


def huge_header_length(adapter: Path) -> None:
    path = adapter / "adapter_model.safetensors"
    data = path.read_bytes()
    path.write_bytes(struct.pack("<Q", 10**12) + data[8:])


def shift_offsets(adapter: Path) -> None:
    # A header whose offsets overlap: the file size still matches, the layout does not.
    path = adapter / "adapter_model.safetensors"
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    name = sorted(k for k in header if k != "__metadata__")[1]
    begin, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [0, end - begin]
    encoded = json.dumps(header, separators=(",", ":")).encode()
    assert len(encoded) <= length  # the new offsets are no longer than the old ones
    path.write_bytes(data[:8] + encoded.ljust(length) + data[8 + length:])


@pytest.mark.parametrize("mutate, status, message", [
    (edit_config("r", 8), 400, "rank mismatch: adapter_config.json says r=8"),
    (edit_config("target_modules", ["q_proj", "k_proj", "v_proj"]), 400, "targets 'k_proj'"),
    (edit_config("target_modules", ["q_proj", "lm_head"]), 400, "target module 'lm_head' is not supported"),
    (edit_config("target_modules", ["q_proj"]), 400, "not a LoRA weight of a target module"),
    (edit_config("use_dora", True), 400, "DoRA"),
    (edit_config("modules_to_save", ["lm_head"]), 400, "modules_to_save"),
    (edit_config("layers_to_transform", [0]), 400, "layers_to_transform"),
    (edit_config("peft_type", "IA3"), 400, "peft_type must be 'LORA'"),
    # lora_alpha: finite, > 0 and <= 4096 (services/common/adapter_layout.py MAX_LORA_ALPHA).
    (edit_config("lora_alpha", float("nan")), 400, "adapter_config.json is not valid JSON: NaN is not allowed"),
    (edit_config("lora_alpha", float("inf")), 400, "adapter_config.json is not valid JSON: Infinity is not allowed"),
    (edit_config("lora_alpha", float("-inf")), 400, "-Infinity is not allowed"),
    (replace_in_config('"lora_alpha": 4', '"lora_alpha": 1e999'), 400, "1e999 overflows a 64-bit float"),
    (edit_config("lora_alpha", 1e308), 400, "lora_alpha must be a finite number in (0, 4096], got 1e+308"),
    (edit_config("lora_alpha", 10**400), 400, "lora_alpha must be a finite number in (0, 4096]"),
    (edit_config("lora_alpha", 0), 400, "lora_alpha must be a finite number in (0, 4096], got 0"),
    (edit_config("lora_alpha", -4), 400, "lora_alpha must be a finite number in (0, 4096], got -4"),
    (edit_config("lora_alpha", "4"), 400, "lora_alpha must be a finite number in (0, 4096], got '4'"),
    # A scaling (alpha / r, r = 2 here) under float16's smallest normal number: the delta would vanish.
    (edit_config("lora_alpha", 1e-320), 400, "lora_alpha 1e-320 at r=2 scales the adapter's delta by 5e-321"),
    (edit_config("lora_alpha", 1e-4), 400, "under 6.1e-05, float16's smallest normal number"),
    # r: 1..1024 (MAX_LORA_RANK), and no more than the smaller side of every target projection.
    (edit_config("r", 0), 400, "r must be an integer from 1 to 1024, got 0"),
    (edit_config("r", -2), 400, "r must be an integer from 1 to 1024, got -2"),
    (edit_config("r", 2048), 400, "r must be an integer from 1 to 1024, got 2048"),
    (edit_config("r", 2.0), 400, "r must be an integer from 1 to 1024, got 2.0"),
    (edit_config("r", 40), 400, "r=40 exceeds the base model's v_proj (64 -> 32); r may be at most 32"),
    (replace_in_config("{", '{"nested": ' + DEEP + ", "), 400, "adapter_config.json nests objects or arrays deeper"),
    (replace_in_config("{", '{"nested": ' + "[" * 65 + "]" * 65 + ", "), 400, "deeper than 64 levels"),
    (header_metadata(DEEP), 400, "adapter_model.safetensors: header nests objects or arrays deeper"),
    (header_metadata('{"scale": NaN}'), 400, "NaN is not allowed (finite numbers only) (corrupt header)"),
    (truncate, 400, "truncated"),
    (corrupt_header, 400, "corrupt header"),
    (huge_header_length, 400, "exceeds"),
    (shift_offsets, 400, "overlaps"),
])
def test_bad_adapters_are_refused(client: FlaskClient, imports: Path, tmp_path: Path,
                                  mutate: Callable[[Path], None], status: int, message: str) -> None:
    adapter = imports / "attn-qv"
    mutate(adapter)
    response = register(client, "bad", adapter)
    assert response.status_code == status, response.get_json()
    assert message in error_of(response)["message"]
    assert client.get("/admin/v1/adapters", headers=AUTH).get_json()["adapters"] == []
    assert [p.name for p in (tmp_path / "store").iterdir()] == [LOCK_FILE]  # nothing staged is left behind


def test_rslora_and_rank_and_alpha_patterns_register_at_their_largest_rank(client: FlaskClient, imports: Path) -> None:
    created = register(client, "patterns", imports / "rslora-patterns")
    assert created.status_code == 201, created.get_json()
    record = created.get_json()
    assert (record["rank"], record["alpha"]) == (8, 4.0)  # layer 1's q_proj; lora_alpha as configured


def add_to_pattern(key: str, pattern_key: str, value: object) -> Callable[[Path], None]:
    """Put `pattern_key` first in the adapter's rank_pattern or alpha_pattern (`key`): PEFT's first match wins."""
    def mutate(adapter: Path) -> None:
        path = adapter / "adapter_config.json"
        config = json.loads(path.read_text())
        config[key] = {pattern_key: value, **config[key]}
        path.write_text(json.dumps(config))
    return mutate


@pytest.mark.parametrize("mutate, message", [
    (add_to_pattern("rank_pattern", "self_attn.v_proj", 2),
     "rank mismatch: adapter_config.json says r=2 but tensor 'base_model.model.model.layers.0.self_attn.v_proj.lora_A"),
    (add_to_pattern("rank_pattern", "layers.1.self_attn.v_proj", 40),
     "r=40 exceeds the base model's v_proj (64 -> 32); r may be at most 32 (layer 1)"),
    (add_to_pattern("rank_pattern", "o_proj", 0), "rank_pattern['o_proj']: r must be an integer from 1 to 1024"),
    (add_to_pattern("alpha_pattern", "o_proj", 1e308), "alpha_pattern['o_proj']: lora_alpha must be a finite number"),
    (add_to_pattern("alpha_pattern", "(o|k)+_proj", 2), "repeats a group"),
    # The smallest alpha over the largest rank (8, layer 1's q_proj), rsLoRA: 1e-4 / sqrt(8) < 2**-14.
    (add_to_pattern("alpha_pattern", "o_proj", 1e-4), "lora_alpha 0.0001 at r=8 scales the adapter's delta by"),
    (add_to_pattern("rank_pattern", "q_proj(", 2), "is not a valid regex"),
    (edit_config("use_dora", True), "use_dora (DoRA) is not supported"),
    (edit_config("use_bdlora", {"nblocks": 2}), "use_bdlora (block-diagonal LoRA) is not supported"),
])
def test_unservable_patterns_and_lora_variants_are_refused(client: FlaskClient, imports: Path,
                                                           mutate: Callable[[Path], None], message: str) -> None:
    adapter = imports / "rslora-patterns"
    mutate(adapter)
    response = register(client, "bad", adapter)
    assert response.status_code == 400, response.get_json()
    assert message in error_of(response)["message"]


class _CreatesMarker:
    """Unpickling this object creates a file: proof of whether a pickle was ever loaded."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (open, (str(self.marker), "w"))


def test_pickle_adapter_is_refused_unopened(client: FlaskClient, imports: Path, tmp_path: Path) -> None:
    adapter = imports / "attn-qv"
    marker = tmp_path / "unpickled.marker"
    (adapter / "adapter_model.safetensors").unlink()
    (adapter / "adapter_model.bin").write_bytes(pickle.dumps(_CreatesMarker(marker)))
    response = register(client, "pickled", adapter)
    assert response.status_code == 400
    assert "pickle adapters are refused; convert to safetensors" in error_of(response)["message"]
    assert not marker.exists()


def test_paths_outside_import_roots_are_refused(client: FlaskClient, imports: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    shutil.copytree(imports / "attn-qv", outside)
    assert register(client, "a", outside).status_code == 403
    # A symlinked directory inside the root that points outside.
    (imports / "link").symlink_to(outside, target_is_directory=True)
    assert register(client, "a", imports / "link").status_code == 403
    # A symlinked weights file inside a real adapter directory that points outside.
    escape = imports / "escape"
    escape.mkdir()
    shutil.copy(outside / "adapter_config.json", escape)
    os.symlink(outside / "adapter_model.safetensors", escape / "adapter_model.safetensors")
    response = register(client, "a", escape)
    assert response.status_code == 403 and "outside the allowed import roots" in error_of(response)["message"]
    # Traversal that lands outside.
    assert register(client, "a", imports / ".." / "outside").status_code == 403


def test_an_adapter_may_not_take_a_base_models_name_nor_the_reverse(client: FlaskClient, imports: Path) -> None:
    clash = register(client, BASE_MODEL, imports / "attn-qv")
    assert clash.status_code == 409
    assert error_of(clash)["message"].startswith(f"{BASE_MODEL!r} is already a base model's name")
    assert register(client, "qv", imports / "attn-qv").status_code == 201
    reverse = client.post("/admin/v1/base-models", headers=AUTH, json={"name": "qv", "path": str(imports / "base")})
    assert reverse.status_code == 409
    assert error_of(reverse)["message"].startswith("'qv' is already an adapter's name")
    assert [b["name"] for b in client.get("/admin/v1/base-models", headers=AUTH).get_json()["base_models"]] == [BASE_MODEL]


@pytest.mark.parametrize("body, message", [
    ('{"name": "x", "base_model": "b", "path": "/x", "tpot_slo_ms": NaN}', "NaN is not allowed"),
    ('{"name": "x", "base_model": "b", "path": ' + DEEP + "}", "nests objects or arrays"),
])
def test_request_bodies_with_nan_or_deep_nesting_are_400(client: FlaskClient, body: str, message: str) -> None:
    response = client.post("/admin/v1/adapters", headers={**AUTH, "Content-Type": "application/json"}, data=body)
    assert response.status_code == 400 and message in error_of(response)["message"]


def test_an_adapters_default_objectives_are_set_at_registration_and_replaced(client: FlaskClient, imports: Path,
                                                                               store: RegistryStore) -> None:
    created = register(client, "sql", imports / "attn-qv", tpot_slo_ms=40, ttft_slo_ms=900.5)
    assert created.status_code == 201
    assert (created.get_json()["tpot_slo_ms"], created.get_json()["ttft_slo_ms"]) == (40, 900.5)
    assert register(client, "plain", imports / "all-proj").get_json()["tpot_slo_ms"] is None  # the gateway's

    replaced = client.put("/admin/v1/adapters/sql/slo", headers=AUTH, json={"tpot_slo_ms": 25})
    assert replaced.status_code == 200
    assert (replaced.get_json()["tpot_slo_ms"], replaced.get_json()["ttft_slo_ms"]) == (25, None)
    record = store.get_adapter("sql")
    assert (record.tpot_slo_ms, record.ttft_slo_ms) == (25, None)
    assert client.put("/admin/v1/adapters/nope/slo", headers=AUTH, json={}).status_code == 404


@pytest.mark.parametrize("field, value, message", [
    ("tpot_slo_ms", 0, "tpot_slo_ms must be a number between 1 and 3600000, got 0"),
    ("ttft_slo_ms", 3_600_001, "ttft_slo_ms must be a number between 1 and 3600000"),
    ("tpot_slo_ms", "fast", "field 'tpot_slo_ms' must be a int or float"),
    ("tpot_slo_ms", True, "tpot_slo_ms must be a number between 1 and 3600000, got True"),
])
def test_bad_default_objectives_are_400_and_register_nothing(client: FlaskClient, imports: Path, field: str,
                                                              value: object, message: str) -> None:
    response = register(client, "sql", imports / "attn-qv", **{field: value})
    assert response.status_code == 400 and message in error_of(response)["message"]
    assert client.get("/admin/v1/adapters/sql", headers=AUTH).status_code == 404
    assert register(client, "sql", imports / "attn-qv").status_code == 201
    replaced = client.put("/admin/v1/adapters/sql/slo", headers=AUTH, json={field: value})
    assert replaced.status_code == 400 and message in error_of(replaced)["message"]
    assert store_slos(client) == (None, None)


def store_slos(client: FlaskClient) -> tuple[object, object]:
    record = client.get("/admin/v1/adapters/sql", headers=AUTH).get_json()
    return record["tpot_slo_ms"], record["ttft_slo_ms"]
