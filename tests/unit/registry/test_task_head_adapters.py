"""The registry derives an adapter's task head from its files (services/common/task_heads.py) and keeps it
as the record's task_head: PEFT's SEQ_CLS score heads and VaLoRA's mlp and detection heads register with
their kind, labels and positions; a head that does not fit the base model or its declaration is a 400 that
names the problem, and nothing is stored."""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from flask.testing import FlaskClient

from registry.app import create_admin_app
from registry.proto_records import adapter_to_proto
from registry.store import RegistryStore
from registry.store_lock import LOCK_FILE
from services.common.task_heads import TaskHead, task_head_from_record

from .conftest import BASE_MODEL, DETECTION_TASK_HEAD, MLP_TASK_HEAD, SEQ_CLS_LABELS
from .head_adapters import HIDDEN, detection_head, mlp_head, write_head_adapter

API_KEY = "test-admin-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture
def client(store: RegistryStore) -> FlaskClient:
    return create_admin_app(store, API_KEY).test_client()


def register(client: FlaskClient, name: str, path: Path, **extra: object) -> Any:
    return client.post("/admin/v1/adapters", headers=AUTH,
                       json={"name": name, "base_model": BASE_MODEL, "path": str(path), **extra})


def listed(client: FlaskClient) -> dict[str, Any]:
    """The admin listing: adapter name -> its task_head."""
    adapters = client.get("/admin/v1/adapters", headers=AUTH).get_json()["adapters"]
    return {a["name"]: a["task_head"] for a in adapters}


def test_a_peft_seq_cls_adapter_registers_with_its_score_head_as_a_classifier(client: FlaskClient, imports: Path,
                                                                             store: RegistryStore) -> None:
    created = register(client, "sentiment", imports / "seq-cls")
    assert created.status_code == 201, created.get_json()
    record = created.get_json()
    assert (record["rank"], record["target_modules"]) == (4, ["q_proj", "v_proj"])  # score.weight is no LoRA tensor
    expected = TaskHead("classifier", tuple(SEQ_CLS_LABELS), (("score.weight", (3, HIDDEN)),))
    assert record["task_head"] == expected.to_json()
    assert listed(client) == {"sentiment": expected.to_json()}
    # The gateways' and workers' view: the Adapter message's task_head_json, back to the same head.
    assert task_head_from_record(adapter_to_proto(store.get_adapter("sentiment")).task_head_json) == expected


def test_a_plain_lora_adapter_has_no_head(client: FlaskClient, imports: Path, store: RegistryStore) -> None:
    assert register(client, "plain", imports / "attn-qv").get_json()["task_head"] is None
    assert adapter_to_proto(store.get_adapter("plain")).task_head_json == ""


@pytest.mark.parametrize("adapter, expected", [
    ("mlp-head", TaskHead("mlp", ("walk", "run", "jump"), tuple(mlp_head(3).items()), activation="gelu")),
    ("detection-head", TaskHead("detection", ("person", "car"), tuple(detection_head(2).items()), positions=8,
                                box_format="xyxy", score_threshold=0.3)),
])
def test_valora_heads_register_with_their_kind_positions_and_labels(client: FlaskClient, imports: Path,
                                                                    adapter: str, expected: TaskHead) -> None:
    created = register(client, adapter, imports / adapter)
    assert created.status_code == 201, created.get_json()
    assert created.get_json()["task_head"] == expected.to_json()
    assert listed(client) == {adapter: expected.to_json()}


def test_the_same_files_registered_again_derive_the_same_head(client: FlaskClient, imports: Path) -> None:
    first = register(client, "first", imports / "detection-head").get_json()
    twin = register(client, "twin", imports / "detection-head").get_json()  # stored once: one digest
    assert client.delete("/admin/v1/adapters/first", headers=AUTH).status_code == 200
    again = register(client, "again", imports / "detection-head").get_json()
    assert first["storage_path"] == twin["storage_path"] == again["storage_path"]
    assert first["task_head"] == twin["task_head"] == again["task_head"] and first["task_head"]["positions"] == 8


def _valora(head: Mapping[str, tuple[int, ...]], config: Mapping[str, Any]) -> Any:
    return lambda directory: write_head_adapter(directory, head, config)


def _seq_cls_id2label(id2label: dict[str, str]) -> Any:
    def mutate(directory: Path) -> None:
        shutil.copytree(directory.parent / "seq-cls", directory)
        path = directory / "adapter_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "id2label": id2label}))
    return mutate


MLP = {"task_head": MLP_TASK_HEAD}


@pytest.mark.parametrize("write, message", [
    (_valora(mlp_head(3, hidden=48), MLP),
     "head tensor base_model.model.task_head.fc1.weight has shape [16, 48], expected [16, 64]"),
    (_valora({"score.weight": (3, 48)}, {"task_type": "SEQ_CLS", "modules_to_save": ["score"]}),
     "head tensor score.weight has shape [3, 48], expected [num_labels, 64]"),
    (_valora(mlp_head(4), MLP), "base_model.model.task_head.fc2.weight has shape [4, 16], expected [3, 16]"),
    (_valora(detection_head(3), {"task_head": DETECTION_TASK_HEAD}),
     "task_head.class_embed.weight has shape [4, 64], expected [3, 64]"),
    (_seq_cls_id2label({"0": "negative", "1": "positive"}), "id2label must map each label index 0..2"),
    (_valora(mlp_head(3), {}), "holds head tensors ('task_head.fc1.bias', ...) but adapter_config.json declares no head"),
    (_valora({}, MLP), "the head lacks tensor base_model.model.task_head.fc1.weight"),
    (_valora({}, {"task_type": "SEQ_CLS", "modules_to_save": ["score"]}),
     "a SEQ_CLS adapter holds exactly one head module, 'score' or 'classifier'; found none"),
    (_valora(mlp_head(3), {"task_head": {**MLP_TASK_HEAD, "dropout": 0.1}}),
     "task_head has unknown field 'dropout' for kind 'mlp'"),
    (_valora(mlp_head(3), {"task_head": {**MLP_TASK_HEAD, "kind": "segmentation"}}),
     "task_head.kind must be 'mlp' or 'detection', got 'segmentation'"),
])
def test_a_head_that_does_not_fit_is_a_400_naming_it_and_nothing_is_stored(client: FlaskClient, imports: Path,
                                                                           tmp_path: Path, write: Any,
                                                                           message: str) -> None:
    write(imports / "bad")
    response = register(client, "bad", imports / "bad")
    assert response.status_code == 400, response.get_json()
    assert message in response.get_json()["error"]["message"]
    assert listed(client) == {}
    assert [p.name for p in (tmp_path / "store").iterdir()] == [LOCK_FILE]  # nothing staged is left behind


def test_the_old_task_head_body_field_is_refused_saying_where_the_head_comes_from(client: FlaskClient,
                                                                                  imports: Path) -> None:
    response = register(client, "sentiment", imports / "seq-cls", task_head={"labels": ["cat", "dog"]})
    assert response.status_code == 400
    error = response.get_json()["error"]
    assert error["message"].startswith("field 'task_head' is not accepted: an adapter's task head is read from its "
                                       "adapter_config.json and adapter_model.safetensors")
    assert "docs/task-heads.md" in error["message"]
    assert listed(client) == {}
