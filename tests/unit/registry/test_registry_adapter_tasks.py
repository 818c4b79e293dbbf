"""Adapters record the tasks they serve (docs/fuse.md, "Routing by task"): the store, the admin API, the
migration that added them and the proto the gateways read them from."""

from __future__ import annotations

from pathlib import Path

import pytest
from alembic import command
from flask.testing import FlaskClient
from sqlalchemy import text

from registry.app import create_admin_app
from registry.db import alembic_config, make_engine, upgrade_schema
from registry.proto_records import adapter_to_proto
from registry.records import AdapterTask
from registry.store import RegistryStore
from services.common.errors import InvalidArgument

from .conftest import BASE_MODEL

API_KEY = "test-admin-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
SHAPE = AdapterTask("shape", 0.97, "accuracy")
COUNT = AdapterTask("count-2", 1, "exact_match")
SHAPE_JSON = {"name": "shape", "accuracy": 0.97, "metric": "accuracy"}


@pytest.fixture
def client(store: RegistryStore) -> FlaskClient:
    return create_admin_app(store, API_KEY).test_client()


def register(client: FlaskClient, path: Path, tasks: object):  # type: ignore[no-untyped-def]
    return client.post("/admin/v1/adapters", headers=AUTH,
                       json={"name": "fused", "base_model": BASE_MODEL, "path": str(path), "tasks": tasks})


def test_an_adapter_keeps_the_tasks_it_was_registered_with_in_order(store: RegistryStore, imports: Path) -> None:
    record = store.register_adapter("fused", BASE_MODEL, str(imports / "attn-qv"), tasks=[SHAPE, COUNT])
    assert record.tasks == (SHAPE, AdapterTask("count-2", 1.0, "exact_match"))
    assert store.get_adapter("fused").tasks == record.tasks
    assert [a.tasks for a in store.list_adapters()] == [record.tasks]
    assert store.register_adapter("plain", BASE_MODEL, str(imports / "all-proj")).tasks == ()


def test_two_adapters_may_serve_one_task(store: RegistryStore, imports: Path) -> None:
    """The gateways send the task to the newer registration; the registry refuses neither."""
    store.register_adapter("fused", BASE_MODEL, str(imports / "attn-qv"), tasks=[SHAPE])
    assert store.register_adapter("fused-v2", BASE_MODEL, str(imports / "all-proj"), tasks=[SHAPE]).tasks == (SHAPE,)


@pytest.mark.parametrize("tasks, message", [
    ([AdapterTask("Shape", 0.9, "accuracy")], "tasks[0].name 'Shape' is invalid"),
    ([AdapterTask("-shape", 0.9, "accuracy")], "tasks[0].name '-shape' is invalid"),
    ([AdapterTask("s" * 64, 0.9, "accuracy")], "is invalid: use 1-63 characters"),
    ([SHAPE, AdapterTask("shape", 0.5, "accuracy")], "tasks[1].name 'shape' is named twice"),
    ([AdapterTask("shape", 1.01, "accuracy")], "tasks[0].accuracy must be a number in [0, 1], got 1.01"),
    ([AdapterTask("shape", -0.1, "accuracy")], "tasks[0].accuracy must be a number in [0, 1]"),
    ([AdapterTask("shape", float("nan"), "accuracy")], "tasks[0].accuracy must be a number in [0, 1], got nan"),
    ([AdapterTask("shape", float("inf"), "accuracy")], "tasks[0].accuracy must be a number in [0, 1], got inf"),
    ([AdapterTask("shape", True, "accuracy")], "tasks[0].accuracy must be a number in [0, 1], got True"),
    ([AdapterTask("shape", 0.9, "f1")], "tasks[0].metric 'f1' is not one of exact_match, accuracy, map50"),
])
def test_bad_tasks_are_refused_and_register_nothing(store: RegistryStore, imports: Path, tasks: list[AdapterTask],
                                                     message: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        store.register_adapter("fused", BASE_MODEL, str(imports / "attn-qv"), tasks=tasks)
    assert message in info.value.message and info.value.param.startswith("tasks[")
    assert store.list_adapters() == []


def test_names_starting_with_task_prefix_are_refused(store: RegistryStore, imports: Path) -> None:
    with pytest.raises(InvalidArgument, match="'task:' starts a task's name in requests"):
        store.register_adapter("task:shape", BASE_MODEL, str(imports / "attn-qv"))
    with pytest.raises(InvalidArgument, match="'task:' starts a task's name in requests"):
        store.register_base_model("task:base", str(imports / "base"))


def test_admin_api_registers_and_lists_tasks(client: FlaskClient, imports: Path) -> None:
    created = register(client, imports / "attn-qv", [SHAPE_JSON])
    assert created.status_code == 201 and created.get_json()["tasks"] == [SHAPE_JSON]
    listed = client.get("/admin/v1/adapters", headers=AUTH).get_json()["adapters"]
    assert [a["tasks"] for a in listed] == [[SHAPE_JSON]]
    assert client.get("/admin/v1/adapters/fused", headers=AUTH).get_json()["tasks"] == [SHAPE_JSON]
    plain = client.post("/admin/v1/adapters", headers=AUTH,
                        json={"name": "plain", "base_model": BASE_MODEL, "path": str(imports / "all-proj")})
    assert plain.status_code == 201 and plain.get_json()["tasks"] == []


@pytest.mark.parametrize("tasks, message", [
    ("shape", "field 'tasks' must be a list"),
    (["shape"], "tasks[0] must be an object with exactly the fields name, accuracy and metric"),
    ([{"name": "shape", "accuracy": 0.9}], "tasks[0] must be an object with exactly the fields"),
    ([SHAPE_JSON, {**SHAPE_JSON, "floor": 0.9}], "tasks[1] must be an object with exactly the fields"),
    ([{**SHAPE_JSON, "name": "Shape!"}], "tasks[0].name 'Shape!' is invalid"),
    ([{**SHAPE_JSON, "name": 7}], "tasks[0].name 7 is invalid"),
    ([SHAPE_JSON, SHAPE_JSON], "tasks[1].name 'shape' is named twice"),
    ([{**SHAPE_JSON, "accuracy": "high"}], "tasks[0].accuracy must be a number in [0, 1], got 'high'"),
    ([{**SHAPE_JSON, "accuracy": 97}], "tasks[0].accuracy must be a number in [0, 1], got 97"),
    ([{**SHAPE_JSON, "metric": "bleu"}], "tasks[0].metric 'bleu' is not one of exact_match, accuracy, map50"),
])
def test_admin_api_bad_tasks_are_400_naming_the_field(client: FlaskClient, imports: Path, tasks: object,
                                                      message: str) -> None:
    response = register(client, imports / "attn-qv", tasks)
    assert response.status_code == 400 and message in response.get_json()["error"]["message"]
    assert client.get("/admin/v1/adapters/fused", headers=AUTH).status_code == 404


def test_the_proto_carries_the_tasks(store: RegistryStore, imports: Path) -> None:
    proto = adapter_to_proto(store.register_adapter("fused", BASE_MODEL, str(imports / "attn-qv"), tasks=[SHAPE]))
    assert [(t.name, t.accuracy, t.metric) for t in proto.tasks] == [("shape", 0.97, "accuracy")]
    assert list(adapter_to_proto(store.register_adapter("plain", BASE_MODEL, str(imports / "all-proj"))).tasks) == []


def test_0008_keeps_existing_adapters_with_no_tasks(imports: Path, tmp_path: Path, empty_database_url: str) -> None:
    url = empty_database_url
    engine = make_engine(url)
    with engine.begin() as connection:
        config = alembic_config()
        config.attributes["connection"] = connection
        command.upgrade(config, "0007")
        connection.execute(text(
            "INSERT INTO base_models (name, architecture, path, max_context, vocab_size, hidden_size, num_layers, "
            "module_shapes, created_ms) VALUES ('tiny', 'LlamaForCausalLM', '/m', 256, 128, 64, 2, '{}', 0)"))
        connection.execute(text(
            "INSERT INTO adapters (name, base_model, rank, alpha, target_modules, size_bytes, sha256, storage_path, "
            "created_ms) VALUES ('old', 'tiny', 2, 4.0, '[\"q_proj\"]', 1, :sha, '/s', 0)"), {"sha": "a" * 64})
    upgrade_schema(url)
    with engine.connect() as connection:
        assert connection.execute(text("SELECT tasks FROM adapters WHERE name = 'old'")).scalar() is None
    engine.dispose()
    store = RegistryStore(url, tmp_path / "store", [imports], worker_timeout_s=10.0)
    assert store.get_adapter("old").tasks == ()
    store.close()
