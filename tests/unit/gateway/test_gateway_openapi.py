"""GET /openapi.json: the REST API as OpenAPI 3.1, from the schemas the gateway validates with."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
import requests

from tests.unit.gateway.gateway_fakes import ADAPTER, BASE, GatewayEnv

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def env() -> Iterator[GatewayEnv]:
    env = GatewayEnv()
    yield env
    env.close()


@pytest.fixture(scope="module")
def document(env: GatewayEnv) -> dict[str, Any]:
    response = requests.get(f"{env.http_base}/openapi.json", timeout=10)
    assert response.status_code == 200 and response.headers["Content-Type"] == "application/json"
    return response.json()


def test_document_describes_the_api(document: dict[str, Any]) -> None:
    assert document["openapi"] == "3.1.0"
    assert set(document["paths"]) == {"/v1/chat/completions", "/v1/completions", "/v1/classify", "/v1/models",
                                      "/healthz", "/openapi.json"}
    chat = document["paths"]["/v1/chat/completions"]["post"]
    assert chat["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ChatCompletionRequest"}
    assert {"200", "400", "404", "429", "503"} <= set(chat["responses"])
    assert "Retry-After" in chat["responses"]["429"]["headers"]
    assert "security" not in document, "no keys configured: nothing to send"
    for schema in document["components"]["schemas"].values():
        jsonschema.Draft202012Validator.check_schema(schema)


def test_limits_are_this_gateways(env: GatewayEnv, document: dict[str, Any]) -> None:
    fields = document["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert fields["max_tokens"]["maximum"] == env.config.gateway.max_tokens_limit == 64
    text = document["components"]["schemas"]["CompletionRequest"]["properties"]["prompt"]["anyOf"][0]
    assert text["maxLength"] == env.config.gateway.max_prompt_chars


@pytest.mark.parametrize(("path", "body"), [
    ("chat/completions", {"model": BASE, "messages": MESSAGES}),
    ("chat/completions", {"model": ADAPTER, "messages": MESSAGES, "max_tokens": 64, "temperature": 2, "top_p": 1,
                          "top_k": 2**31 - 1, "seed": 2**64 - 1, "stop": ["x"] * 4, "stop_token_ids": [0] * 64,
                          "logprobs": True, "top_logprobs": 20, "tessera_slo": {"tpot_ms": 1}, "n": 1}),
    ("chat/completions", {"model": BASE, "messages": MESSAGES, "max_tokens": 65}),
    ("chat/completions", {"model": BASE, "messages": MESSAGES, "top_k": 2**31}),
    ("chat/completions", {"model": BASE, "messages": MESSAGES, "seed": -1}),
    ("chat/completions", {"model": BASE, "messages": MESSAGES, "stop": ["x"] * 5}),
    ("chat/completions", {"model": BASE, "messages": MESSAGES, "tessera_slo": {"tpot": 1}}),
    ("chat/completions", {"model": BASE, "messages": [{"role": "robot", "content": "hi"}]}),
    ("chat/completions", {"model": BASE, "messages": [{"role": "user", "content": [{"type": "text"}]}]}),
    ("chat/completions", {"model": BASE}),
    ("completions", {"model": BASE, "prompt": "hi", "logprobs": 5}),
    ("completions", {"model": BASE, "prompt": "hi", "logprobs": 6}),
    ("completions", {"model": BASE, "prompt": ["a", "b"]}),
    ("completions", {"model": BASE, "prompt": ""}),
])
def test_the_gateway_accepts_exactly_what_the_document_allows(
        env: GatewayEnv, document: dict[str, Any], path: str, body: dict[str, Any]) -> None:
    name = {"chat/completions": "ChatCompletionRequest", "completions": "CompletionRequest"}[path]
    valid = jsonschema.Draft202012Validator(document["components"]["schemas"][name]).is_valid(body)
    response = requests.post(f"{env.http_base}/v1/{path}", json=body, timeout=30)
    assert response.status_code == (200 if valid else 400), response.text


def test_with_api_keys_the_document_names_the_bearer_scheme_and_is_still_open() -> None:
    env = GatewayEnv(api_keys=["k"])
    try:
        document = requests.get(f"{env.http_base}/openapi.json", timeout=10).json()
    finally:
        env.close()
    scheme = document["components"]["securitySchemes"]["apiKey"]
    assert (scheme["type"], scheme["scheme"]) == ("http", "bearer")
    assert document["security"] == [{"apiKey": []}]
    assert document["paths"]["/healthz"]["get"]["security"] == []
    assert "401" in document["paths"]["/v1/chat/completions"]["post"]["responses"]
