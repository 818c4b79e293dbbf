"""The admin REST API (/admin/v1): base models, adapters, workers and placements.

Every route needs the admin API key (``Authorization: Bearer <key>`` or
``X-API-Key: <key>``); errors are JSON ``{"error": {"message", "type", "code"}}``
(see registry/app.py for the handlers).

Placement orders hold an adapter on workers without waiting for a request:
  POST   /adapters/<name>/placements        {"workers": ["<worker id>", ...] | "all", "pin": false}
         preload (pin false: loaded into host and GPU memory once, then evicted like any adapter) or
         pin (never evicted while the order stands) on those workers, or on every worker of the
         adapter's base model ("all", workers that register later included)
  GET    /adapters/<name>/placements        its orders
  DELETE /adapters/<name>/placements/<worker id | all>   lift an order (a pin is released)
What workers actually hold (tier, loading, pinned) is GET /placements.
"""

from __future__ import annotations

import dataclasses
import hmac
from typing import Any

from flask import Blueprint, Response, current_app, jsonify, request

from registry.metrics import ADAPTERS_REGISTERED
from registry.records import AdapterTask
from registry.store import RegistryStore
from services.common.errors import InvalidArgument, PermissionDenied, Unauthenticated
from services.common.strict_json import loads as strict_json_loads
from services.common.text_fields import check_text, check_texts

STORE_EXTENSION = "tessera_registry_store"
API_KEY_CONFIG = "TESSERA_ADMIN_API_KEY"

admin = Blueprint("admin", __name__, url_prefix="/admin/v1")


def json_error(status: int, message: str, error_type: str) -> tuple[Response, int]:
    return jsonify({"error": {"message": message, "type": error_type, "code": status}}), status


def _store() -> RegistryStore:
    return current_app.extensions[STORE_EXTENSION]


def _supplied_key() -> str | None:
    authorization = request.headers.get("Authorization", "")
    if authorization.lower().startswith("bearer "):
        return authorization[len("bearer "):].strip()
    return request.headers.get("X-API-Key")


@admin.before_request
def require_api_key() -> None:
    supplied = _supplied_key()
    if not supplied:
        raise Unauthenticated("missing admin API key: send 'Authorization: Bearer <key>' or 'X-API-Key: <key>'")
    if not hmac.compare_digest(supplied.encode(), current_app.config[API_KEY_CONFIG].encode()):
        raise PermissionDenied("invalid admin API key")
    # Names in the URL and the query string reach the database: a NUL there is a 400, not a 500.
    for key, value in (request.view_args or {}).items():
        check_text(str(value), key)
    for key, value in request.args.items(multi=True):
        check_text(value, key)


# An adapter's default objectives, in ms (services/common/slo.py checks their range).
SLO_FIELDS: dict[str, type | tuple[type, ...]] = {"tpot_slo_ms": (int, float), "ttft_slo_ms": (int, float)}
# Fields an earlier API took: refused saying why, not as merely unknown.
RETIRED_FIELDS: dict[str, str] = {
    "task_head": "an adapter's task head is read from its adapter_config.json and adapter_model.safetensors "
                 "at registration (docs/task-heads.md)"}


def _json_body(fields: dict[str, type | tuple[type, ...]], required: set[str]) -> dict[str, Any]:
    """The request's JSON object, with each field of the expected type; InvalidArgument otherwise."""
    body = strict_json_loads(request.get_data() or b"null", "request body")
    if not isinstance(body, dict):
        raise InvalidArgument("request body must be a JSON object")
    for key in body:
        if key in RETIRED_FIELDS:
            raise InvalidArgument(f"field {key!r} is not accepted: {RETIRED_FIELDS[key]}", param=key)
        if key not in fields:
            raise InvalidArgument(f"unknown field {key!r}; expected: {', '.join(fields)}", param=key)
    for key, value in body.items():
        check_texts(value, key)
    for key, expected in fields.items():
        if key not in body or body[key] is None:
            if key in required:
                raise InvalidArgument(f"missing required field {key!r}", param=key)
            continue
        if not isinstance(body[key], expected):
            kinds = expected if isinstance(expected, tuple) else (expected,)
            raise InvalidArgument(f"field {key!r} must be a {' or '.join(k.__name__ for k in kinds)}", param=key)
    return body


def _record(record: Any) -> dict[str, Any]:
    return dataclasses.asdict(record)


@admin.post("/base-models")
def register_base_model() -> tuple[Response, int]:
    body = _json_body({"name": str, "path": str}, required={"name", "path"})
    return jsonify(_record(_store().register_base_model(body["name"], body["path"]))), 201


@admin.get("/base-models")
def list_base_models() -> Response:
    return jsonify({"base_models": [_record(r) for r in _store().list_base_models()]})


def _tasks_field(value: list[Any] | None) -> list[AdapterTask] | None:
    """The body's "tasks": [{"name": "shape", "accuracy": 0.97, "metric": "accuracy"}, ...]; the store checks
    the values, this their shape."""
    if value is None:
        return None
    tasks = []
    for i, item in enumerate(value):
        if not isinstance(item, dict) or set(item) != {"name", "accuracy", "metric"}:
            raise InvalidArgument(f"tasks[{i}] must be an object with exactly the fields name, accuracy and metric",
                                  param=f"tasks[{i}]")
        tasks.append(AdapterTask(item["name"], item["accuracy"], item["metric"]))
    return tasks


@admin.post("/adapters")
def register_adapter() -> tuple[Response, int]:
    body = _json_body({"name": str, "base_model": str, "path": str, **SLO_FIELDS, "tasks": list},
                      required={"name", "base_model", "path"})
    record = _store().register_adapter(body["name"], body["base_model"], body["path"], body.get("tpot_slo_ms"),
                                       body.get("ttft_slo_ms"), _tasks_field(body.get("tasks")))
    ADAPTERS_REGISTERED.inc()
    return jsonify(_record(record)), 201


@admin.get("/adapters")
def list_adapters() -> Response:
    records = _store().list_adapters(base_model=request.args.get("base_model") or None)
    return jsonify({"adapters": [_record(r) for r in records]})


@admin.get("/adapters/<name>")
def get_adapter(name: str) -> Response:
    return jsonify(_record(_store().get_adapter(name)))


@admin.put("/adapters/<name>/slo")
def set_adapter_slos(name: str) -> Response:
    """The adapter's default objectives, both replaced (a field left out or null: the gateway's default)."""
    body = _json_body(SLO_FIELDS, required=set())
    return jsonify(_record(_store().set_adapter_slos(name, body.get("tpot_slo_ms"), body.get("ttft_slo_ms"))))


@admin.delete("/adapters/<name>")
def delete_adapter(name: str) -> Response:
    """New requests for `name` get 404 at once; in-flight ones finish; then every worker drops it."""
    _store().delete_adapter(name)
    return jsonify({"deleted": name})


def _workers_field(value: Any) -> list[str] | None:
    """The body's "workers": "all" -> None, or a non-empty list of worker ids."""
    if value == "all":
        return None
    if not isinstance(value, list) or not value or not all(isinstance(w, str) and w for w in value):
        raise InvalidArgument('field \'workers\' must be "all" or a non-empty list of worker ids', param="workers")
    return list(dict.fromkeys(value))


@admin.post("/adapters/<name>/placements")
def place_adapter(name: str) -> Response:
    body = _json_body({"workers": object, "pin": bool}, required={"workers"})
    orders = _store().place_adapter(name, _workers_field(body["workers"]), bool(body.get("pin", False)))
    return jsonify({"orders": [_record(r) for r in orders]})


@admin.get("/adapters/<name>/placements")
def list_placement_orders(name: str) -> Response:
    return jsonify({"orders": [_record(r) for r in _store().list_placement_orders(name)]})


@admin.delete("/adapters/<name>/placements/<worker>")
def remove_placement_order(name: str, worker: str) -> Response:
    removed = _store().remove_placement_orders(name, None if worker == "all" else [worker])
    return jsonify({"removed": [_record(r) for r in removed]})


@admin.get("/workers")
def list_workers() -> Response:
    healthy_only = request.args.get("healthy_only", "false").lower() in ("1", "true", "yes")
    records = _store().list_workers(base_model=request.args.get("base_model") or None, healthy_only=healthy_only)
    return jsonify({"workers": [_record(r) for r in records]})


@admin.get("/placement-plan")
def placement_plan() -> Response:
    """The placement planner's last decisions: each planned adapter's tier ("gpu": hot, its replicas;
    "host": warm), the workers holding it there and its requests/s when planned. Adapters not listed are cold."""
    records = _store().list_planned_placements(base_model=request.args.get("base_model") or None)
    adapters: dict[str, dict[str, Any]] = {}
    for r in records:
        entry = adapters.setdefault(r.adapter, {"adapter": r.adapter, "tier": r.tier, "rate": 0.0, "workers": [],
                                                "planned_unix_ms": r.planned_unix_ms})
        entry["workers"].append(r.worker_address)
        entry["rate"] += r.rate  # each worker's share
    return jsonify({"adapters": sorted(adapters.values(), key=lambda e: (-e["rate"], e["adapter"]))})


@admin.get("/placements")
def list_placements() -> Response:
    records = _store().list_placements(adapter=request.args.get("adapter") or None,
                                       worker_id=request.args.get("worker_id") or None)
    return jsonify({"placements": [_record(r) for r in records]})
