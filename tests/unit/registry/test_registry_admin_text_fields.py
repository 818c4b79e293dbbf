"""Every string the admin API takes — body fields (nested ones too), URL segments, query arguments — is
refused with a 400 naming it when it holds a NUL or a lone surrogate, on SQLite and PostgreSQL alike:
never a 500 (os.path.realpath raises ValueError on a NUL; PostgreSQL refuses NUL in text), and nothing
registered. The routes are read off the app itself, so a new route must join these tables."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from flask.testing import FlaskClient

from registry.app import create_admin_app
from registry.store import RegistryStore

from .conftest import BASE_MODEL

API_KEY = "test-admin-key"
AUTH = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
BAD_TEXTS = {"nul": "\x00", "nul-suffix": "x\x00y", "lone-surrogate": "\ud800"}

# method, rule -> a valid body (None: none), with "{adapter}" standing for a valid adapter path.
BODIES: dict[tuple[str, str], dict[str, Any] | None] = {
    ("POST", "/admin/v1/base-models"): {"name": "second-base", "path": "{base}"},
    ("POST", "/admin/v1/adapters"): {"name": "a", "base_model": BASE_MODEL, "path": "{adapter}"},
    ("PUT", "/admin/v1/adapters/<name>/slo"): {"tpot_slo_ms": 50},
    ("POST", "/admin/v1/adapters/<name>/placements"): {"workers": ["w1"], "pin": False},
}
QUERY_ARGS = {"/admin/v1/adapters": ["base_model"], "/admin/v1/workers": ["base_model", "healthy_only"],
              "/admin/v1/placement-plan": ["base_model"], "/admin/v1/placements": ["adapter", "worker_id"]}


@pytest.fixture
def client(store: RegistryStore) -> FlaskClient:
    return create_admin_app(store, API_KEY).test_client()


def _admin_routes(client: FlaskClient) -> list[tuple[str, str]]:
    rules = client.application.url_map.iter_rules()
    return sorted((method, rule.rule) for rule in rules if rule.rule.startswith("/admin/")
                  for method in rule.methods - {"HEAD", "OPTIONS"})


def _string_paths(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Where the strings sit in a JSON value: each a path of keys and indexes."""
    if isinstance(value, str):
        return [path]
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _string_paths(v, (*path, k))]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _string_paths(v, (*path, i))]
    return []


def _replaced(value: Any, path: tuple[Any, ...], bad: str) -> Any:
    if not path:
        return value + bad
    copy = dict(value) if isinstance(value, dict) else list(value)
    copy[path[0]] = _replaced(value[path[0]], path[1:], bad)
    return copy


def _body_cases() -> list[tuple[str, str, tuple[Any, ...], str]]:
    return [(method, rule, path, bad) for (method, rule), body in BODIES.items() if body
            for path in _string_paths(body) for bad in BAD_TEXTS]


def test_the_tables_cover_every_admin_route(client: FlaskClient) -> None:
    writes = {(m, r) for m, r in _admin_routes(client) if m in ("POST", "PUT")}
    assert writes == set(BODIES), "a route that takes a body joins BODIES"


def _assert_refused(response: Any, field: str) -> None:
    assert response.status_code == 400, (response.status_code, response.get_data(as_text=True))
    error = response.get_json()["error"]
    assert error["type"] == "invalid_request_error" and field in error["message"], error


@pytest.mark.parametrize("method, rule, path, bad", _body_cases())
def test_a_bad_character_in_any_body_string_is_a_400_naming_it(client: FlaskClient, imports: Path, method: str,
                                                               rule: str, path: tuple[Any, ...], bad: str) -> None:
    assert client.post("/admin/v1/adapters", headers=AUTH, data=json.dumps(
        {"name": "existing", "base_model": BASE_MODEL, "path": str(imports / "attn-qv")})).status_code == 201
    body = json.loads(json.dumps(BODIES[(method, rule)]).replace("{base}", str(imports / "base"))
                      .replace("{adapter}", str(imports / "all-proj")))
    url = rule.replace("<name>", "existing")
    # json.dumps escapes both ("\u0000", "\ud800"): the bytes on the wire are what a client sends.
    response = client.open(url, method=method, headers=AUTH, data=json.dumps(_replaced(body, path, BAD_TEXTS[bad])))
    _assert_refused(response, str(path[0]))
    adapters = client.get("/admin/v1/adapters", headers=AUTH).get_json()["adapters"]
    assert [a["name"] for a in adapters] == ["existing"], "nothing registered"
    assert len(client.get("/admin/v1/base-models", headers=AUTH).get_json()["base_models"]) == 1


# As a client puts them in a URL: percent-encoded bytes (a lone surrogate's UTF-8-like form is not UTF-8).
BAD_URL_TEXTS = {"nul": "%00", "nul-suffix": "x%00y", "surrogate-bytes": "%ED%A0%80"}


@pytest.mark.parametrize("bad", BAD_URL_TEXTS)
def test_a_bad_character_in_a_url_segment_or_query_argument_is_never_a_server_error(client: FlaskClient,
                                                                                    bad: str) -> None:
    """A NUL is a 400 naming the segment or argument; bytes that are not UTF-8 decode to U+FFFD (werkzeug),
    a name like any other: 400 or 404, never 5xx."""
    for method, rule in _admin_routes(client):
        segments = [part[1:-1] for part in rule.split("/") if part.startswith("<")]
        for segment in segments:
            url = rule
            for other in segments:
                url = url.replace(f"<{other}>", BAD_URL_TEXTS[bad] if other == segment else "x")
            _assert_refused_or_unknown(client.open(url, method=method, headers=AUTH, data="{}"), segment, bad)
    for route, arguments in QUERY_ARGS.items():
        for argument in arguments:
            _assert_refused_or_unknown(client.get(f"{route}?{argument}={BAD_URL_TEXTS[bad]}", headers=AUTH),
                                       argument, bad)


def _assert_refused_or_unknown(response: Any, field: str, bad: str) -> None:
    if bad.startswith("nul"):
        _assert_refused(response, field)
    else:
        assert response.status_code in (200, 400, 404), (response.status_code, response.get_data(as_text=True))
