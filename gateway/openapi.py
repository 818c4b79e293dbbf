"""The REST API as an OpenAPI 3.1 document, served at GET /openapi.json without a key.

The request bodies are gateway/rest_schema.py's declarations, the very schemas every body is
validated against, with this gateway's limits filled in (max_tokens_limit, max_prompt_chars); the
responses describe OpenAI's objects and the one error shape (gateway/http_errors.py). Where
`gateway.api_keys` is set, every /v1 operation names the bearer scheme.
"""

from __future__ import annotations

from typing import Any

from services.common.config import GatewayConfig

from gateway.rest_schema import REQUEST_SCHEMAS

OPENAPI_VERSION = "3.1.0"
API_VERSION = "v1"


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


_USAGE_FIELDS = ("prompt_tokens", "completion_tokens", "total_tokens")
_USAGE = {"type": "object", "required": list(_USAGE_FIELDS),
          "properties": {name: {"type": "integer"} for name in _USAGE_FIELDS}}
_FINISH_REASON = {"enum": ["stop", "length"]}
_LOGPROBS = {"type": ["object", "null"], "description": "Present when the request asked for log-probabilities."}


def _completion_object(object_: str, choice: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"], "properties": {
        "id": {"type": "string"}, "object": {"const": object_}, "created": {"type": "integer"},
        "model": {"type": "string"},
        "choices": {"type": "array", "items": {
            "type": "object", "required": ["index", "finish_reason"],
            "properties": {"index": {"type": "integer"}, **choice, "logprobs": _LOGPROBS,
                           "finish_reason": _FINISH_REASON}}},
        "usage": _USAGE}}


RESPONSE_SCHEMAS: dict[str, dict[str, Any]] = {
    "ChatCompletion": _completion_object("chat.completion", {"message": {
        "type": "object", "required": ["role", "content"],
        "properties": {"role": {"const": "assistant"}, "content": {"type": "string"}}}}),
    "Completion": _completion_object("text_completion", {"text": {"type": "string"}}),
    "ModelList": {"type": "object", "required": ["object", "data"], "properties": {
        "object": {"const": "list"},
        "data": {"type": "array", "items": {
            "type": "object", "required": ["id", "object", "created", "owned_by", "root", "parent"], "properties": {
                "id": {"type": "string"}, "object": {"const": "model"}, "created": {"type": "integer"},
                "owned_by": {"type": "string"}, "root": {"type": "string", "description": "Its base model."},
                "parent": {"type": ["string", "null"],
                           "description": "An adapter's base model; a task's (task:<name>) adapter; null for a base."}
            }}}}},
    "Classification": {"type": "object", "required": ["id", "object", "created", "model", "data", "usage"],
                       "properties": {
        "id": {"type": "string"}, "object": {"const": "list"}, "created": {"type": "integer"},
        "model": {"type": "string"},
        "data": {"type": "array", "description": "One item per input, in order.", "items": {"anyOf": [
            {"title": "classification", "type": "object", "required": ["index", "label", "probs", "num_classes"],
             "properties": {"index": {"type": "integer"}, "label": {"type": "string"},
                            "probs": {"type": "array", "items": {"type": "number"},
                                      "description": "One per label, in label-index order."},
                            "num_classes": {"type": "integer"}}},
            {"title": "detection", "type": "object", "required": ["index", "detections"], "properties": {
                "index": {"type": "integer"},
                "detections": {"type": "array", "description": "Above the head's score threshold, best first.",
                               "items": {"type": "object", "required": ["label", "score", "box"], "properties": {
                                   "label": {"type": "string"}, "score": {"type": "number"},
                                   "box": {"type": "array", "items": {"type": "number"}, "minItems": 4,
                                           "maxItems": 4, "description": "[x1, y1, x2, y2], fractions of the "
                                                                         "image's width and height."}}}}}}]}},
        "usage": _USAGE}},
    "Error": {"type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"], "properties": {
            "message": {"type": "string"},
            "type": {"type": "string", "description": "invalid_request_error, not_found_error, overloaded_error, ..."},
            "param": {"type": ["string", "null"], "description": 'The offending field, e.g. "messages[0].content".'},
            "code": {"type": "string", "description": "The gRPC status code's name, lowercase."}}}}},
}

# With stream: true; OpenAPI before 3.2 describes each event of a stream by its schema.
_SSE_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {
    "type": "string", "description": "A chunk (JSON, the completion object with a delta), an error object, or "
                                     "[DONE] last."}}}
_RETRY_AFTER = {"Retry-After": {"description": "Whole seconds to wait before retrying (at least 1).",
                                "schema": {"type": "integer", "minimum": 1}}}


def _error(description: str, retry_after: bool = False) -> dict[str, Any]:
    response: dict[str, Any] = {"description": description,
                                "content": {"application/json": {"schema": _ref("Error")}}}
    if retry_after:
        response["headers"] = _RETRY_AFTER
    return response


def _errors(authenticated: bool) -> dict[str, Any]:
    errors = {
        "400": _error("Invalid request: the message names the field (param)."),
        "404": _error("No such model."),
        "409": _error("The adapter is registered but its worker cannot load it."),
        "413": _error("An image over gateway.max_image_bytes."),
        "429": _error("Overloaded: too many requests in flight for this base model.", retry_after=True),
        "503": _error("No healthy worker serves the model.", retry_after=True),
        "504": _error("The worker did not answer in time."),
        "default": _error("Any other failure, in the same shape."),
    }
    if authenticated:
        errors["401"] = _error("A missing or unknown API key.")
    return dict(sorted(errors.items()))


def _post(summary: str, request: str, ok: dict[str, Any], authenticated: bool) -> dict[str, Any]:
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(request)}}},
        "responses": {"200": ok, **_errors(authenticated)}}}


def _generate(summary: str, request: str, response: str, authenticated: bool) -> dict[str, Any]:
    return _post(summary, request, {
        "description": "The completion; with stream: true, server-sent events of chunks, then `data: [DONE]` (a "
                       "failure after the first chunk is one `data: {\"error\": ...}` event).",
        "content": {"application/json": {"schema": _ref(response)}, "text/event-stream": {"schema": _SSE_EVENT}}},
        authenticated)


def openapi_document(config: GatewayConfig) -> dict[str, Any]:
    authenticated = bool(config.api_keys)
    paths: dict[str, Any] = {
        "/v1/chat/completions": _generate("A chat completion (OpenAI-compatible).", "ChatCompletionRequest",
                                          "ChatCompletion", authenticated),
        "/v1/completions": _generate("A text completion (OpenAI's legacy API).", "CompletionRequest", "Completion",
                                     authenticated),
        "/v1/classify": _post(
            "Each input answered by an adapter's task head (vLLM's /classify): a class or boxes (docs/task-heads.md).",
            "ClassifyRequest", {"description": "The heads' answers.",
                                "content": {"application/json": {"schema": _ref("Classification")}}}, authenticated),
        "/v1/models": {"get": {"summary": "Every base model and adapter.", "responses": {
            "200": {"description": "The models.", "content": {"application/json": {"schema": _ref("ModelList")}}},
            **({"401": _error("A missing or unknown API key.")} if authenticated else {}),
            "503": _error("The registry is unreachable and nothing is cached yet.", retry_after=True),
            "default": _error("Any other failure, in the same shape.")}}},
        "/healthz": {"get": {"summary": "Liveness; never needs a key.", "security": [], "responses": {
            "200": {"description": "Up.", "content": {"application/json": {"schema": {
                "type": "object", "properties": {"status": {"const": "ok"}}}}}}}}},
        "/openapi.json": {"get": {"summary": "This document; never needs a key.", "security": [], "responses": {
            "200": {"description": "OpenAPI 3.1.", "content": {"application/json": {"schema": {"type": "object"}}}}}}},
    }
    components: dict[str, Any] = {"schemas": {name: build(config) for name, build in REQUEST_SCHEMAS.items()}
                                  | RESPONSE_SCHEMAS}
    document: dict[str, Any] = {
        "openapi": OPENAPI_VERSION,
        "info": {"title": "Tessera gateway", "version": API_VERSION,
                 "description": "OpenAI-compatible serving of many LoRA adapters on shared base models. "
                                "The same service over gRPC: tessera.v1.Inference (protos/tessera/v1)."},
        "paths": paths,
        "components": components,
    }
    if authenticated:
        components["securitySchemes"] = {"apiKey": {"type": "http", "scheme": "bearer",
                                                    "description": "A key of gateway.api_keys."}}
        document["security"] = [{"apiKey": []}]
    return document
