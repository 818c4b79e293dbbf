"""The REST request bodies, declared once as JSON Schema (2020-12, OpenAPI 3.1's dialect).

The same declarations validate every body (`check_body`) and are published at /openapi.json
(gateway/openapi.py). Each field states its type and range, and the error message is derived
from that statement, so the document and the 400s cannot drift apart:

    {"model": "m", "messages": [...], "max_tokens": 10**9}
        -> 400, param "max_tokens": "max_tokens must be an integer between 1 and 4096, got 1000000000"

`parse_json` comes first: it turns the raw body into JSON values and refuses, as a 400, what the
schema cannot see or Python would choke on later: NaN/Infinity and deep nesting (a 100,000-deep
array exhausts the recursion limit; services/common/strict_json.py refuses both), and lone
surrogates ("\\ud800" is valid JSON but not Unicode text: no proto string can hold it).
What needs more than one field or more than the JSON stays in code (gateway/schemas.py): a
request may ask for `top_logprobs` only with `logprobs: true`, and for `stream_options` only
with `stream: true`; images are decoded and measured; a chat's characters are summed.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
from jsonschema.exceptions import ValidationError

from services.common import strict_json
from services.common.config import GatewayConfig
from services.common.errors import InvalidArgument
from services.common.text_fields import param_name, strings_in
from services.common.slo import MAX_SLO_MS, MIN_SLO_MS

MAX_SHOWN_CHARS = 80  # of a value quoted back in an error message
MAX_MODEL_CHARS = 256  # registry names are at most 128
MAX_INT32 = 2**31 - 1  # SamplingParams.top_k, stop_token_ids
MAX_UINT64 = 2**64 - 1  # SamplingParams.seed
MAX_TEMPERATURE = 2.0
MAX_STOP_SEQUENCES = 4
MAX_STOP_CHARS = 1024  # of one stop sequence: the worker matches each against every new token's text
MAX_STOP_TOKEN_IDS = 64
MAX_TOP_LOGPROBS = 20  # chat's top_logprobs, and the most a worker returns (either door)
MAX_COMPLETION_LOGPROBS = 5  # /v1/completions' logprobs, OpenAI's limit for the legacy API
CHAT_ROLES = ("system", "user", "assistant")
MAX_CLASSIFY_INPUTS = 64  # of one classify request: each input is a worker request holding an admission place


# Reading the body.

def parse_json(raw: bytes) -> Any:
    """The body's JSON value; InvalidArgument for anything that is not plain, servable JSON."""
    body = strict_json.loads(raw, "the request body")  # finite numbers, bounded nesting
    _check_texts(body)
    return body


def _check_texts(body: Any) -> None:
    """Every string and key is Unicode text."""
    for text, path in strings_in(body):
        _check_text(text, path)


def _check_text(text: str, path: tuple[str | int, ...]) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        param = param_name(path) or None
        raise InvalidArgument(f"{param or 'the request body'} holds a lone surrogate ({text[exc.start]!r} at "
                              f"character {exc.start}), which is not Unicode text", param=param) from None


# The declarations. An optional field also takes null (left out), as OpenAI's API does.

def _optional(schema: dict[str, Any]) -> dict[str, Any]:
    if "type" in schema:
        return {**schema, "type": [schema["type"], "null"]}
    return {**schema, "anyOf": [*schema["anyOf"], {"type": "null"}]}


def _int(low: int, high: int, description: str) -> dict[str, Any]:
    return _optional({"type": "integer", "minimum": low, "maximum": high, "description": description})


def _stop() -> dict[str, Any]:
    sequence = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}
    return _optional({"anyOf": [sequence, {"type": "array", "items": sequence, "maxItems": MAX_STOP_SEQUENCES}],
                      "description": "Text that ends generation when it appears (not part of the output)."})


SLO_OBJECTIVES = {"tpot_ms": "Time per output token", "ttft_ms": "Time to first token"}


def _slo(names: tuple[str, ...] = tuple(SLO_OBJECTIVES)) -> dict[str, Any]:
    def objective(what: str) -> dict[str, Any]:
        return _optional({"type": "number", "minimum": MIN_SLO_MS, "maximum": MAX_SLO_MS,
                          "description": f"{what} in milliseconds; left out: the gateway's default."})

    return _optional({
        "type": "object", "additionalProperties": False,
        "properties": {name: objective(SLO_OBJECTIVES[name]) for name in names},
        "description": "Tessera's extension: the latency objectives routing places the request by."})


def _common_fields(config: GatewayConfig) -> dict[str, Any]:
    """Fields both endpoints take, in the order errors are reported."""
    return {
        "model": {"type": "string", "minLength": 1, "maxLength": MAX_MODEL_CHARS,
                  "description": "A base model or an adapter, as GET /v1/models lists them."},
        "max_tokens": _int(1, config.max_tokens_limit,
                           "The most tokens to generate; left out: the gateway's default_max_tokens."),
        "temperature": _optional({"type": "number", "minimum": 0, "maximum": MAX_TEMPERATURE,
                                  "description": "0 (the default) decodes greedily."}),
        "top_p": _optional({"type": "number", "exclusiveMinimum": 0, "maximum": 1,
                            "description": "Nucleus sampling's probability mass; left out: 1."}),
        "top_k": _int(0, MAX_INT32, "Sample among the k likeliest tokens; 0 or left out: all."),
        "seed": _int(0, MAX_UINT64, "Makes sampling repeatable."),
        "n": _int(1, 1, "Completions per request: only 1."),
        "stop": _stop(),
        "stop_token_ids": _optional({
            "type": "array", "maxItems": MAX_STOP_TOKEN_IDS,
            "items": {"type": "integer", "minimum": 0, "maximum": MAX_INT32},
            "description": "vLLM's extension: token ids that end generation like EOS (the token is kept)."}),
        "stream": _optional({"type": "boolean", "description": "Answer as server-sent events."}),
        "stream_options": _optional({
            "type": "object", "properties": {"include_usage": _optional({"type": "boolean"})},
            "description": "Only with stream: true. include_usage adds a last chunk with the usage."}),
        "tessera_slo": _slo(),
        # OpenAI's own, taken at the value that changes nothing (what a client sends by default); any other
        # value is a 400 naming it, never a request served as if it were not there.
        "presence_penalty": _int(0, 0, "Only 0 (no penalty) for now."),
        "frequency_penalty": _int(0, 0, "Only 0 (no penalty) for now."),
        "logit_bias": _optional({"type": "object", "maxProperties": 0, "description": "Only {} (no bias) for now."}),
    }


# OpenAI's parameters that Tessera does not serve yet: named as such, not as unrecognized.
OPENAI_UNSUPPORTED = frozenset({
    "response_format", "tools", "tool_choice", "parallel_tool_calls", "functions", "function_call", "user",
    "suffix", "echo", "best_of", "service_tier", "store", "metadata", "modalities", "audio", "prediction",
    "reasoning_effort", "web_search_options"})


def _content_part() -> dict[str, Any]:
    return {
        "title": "content part", "type": "object", "required": ["type"],
        "properties": {
            "type": {"enum": ["text", "image_url", "video_url", "video"]},
            "text": {"type": "string"},
            "image_url": {"type": "object", "required": ["url"], "properties": {"url": {
                "type": "string",
                "description": "A base64 data URL (data:image/png;base64,...; PNG, JPEG or WebP), or an http(s) "
                               "URL where the gateway allows remote images."}}},
            "video_url": {"type": "object", "required": ["url"], "additionalProperties": False, "properties": {
                "url": {"type": "string", "description": "A base64 data URL (data:video/mp4;base64,... or "
                                                         "data:video/webm;...), or an http(s) URL as for images."},
                "fps": {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": 1000,
                        "description": "Frames sampled per second of the video (default 2)."},
                "max_frames": {"type": ["integer", "null"], "minimum": 1, "maximum": MAX_INT32}}},
            "video": {"type": "array", "minItems": 1, "items": {"type": "string"},
                      "description": "A video's frames in time order, each an image URL as in image_url."},
        },
        "allOf": [{"if": {"properties": {"type": {"const": kind}}}, "then": {"required": [field]}}
                  for kind, field in (("text", "text"), ("image_url", "image_url"), ("video_url", "video_url"),
                                      ("video", "video"))],
    }


def chat_request_schema(config: GatewayConfig) -> dict[str, Any]:
    fields = _common_fields(config)
    message = {
        "title": "message", "type": "object", "required": ["role", "content"],
        "properties": {
            "role": {"enum": list(CHAT_ROLES)},
            "content": {"anyOf": [{"type": "string", "maxLength": config.max_prompt_chars},
                                  {"type": "array", "items": _content_part()}],
                        "description": "Text, or a list of text and image_url parts (images for "
                                       "vision-language models only)."},
        },
    }
    return {
        "type": "object", "required": ["model", "messages"], "additionalProperties": False,
        "description": f"All messages together hold at most {config.max_prompt_chars} characters of text and "
                       f"{config.max_images_per_request} images.",
        "properties": {
            "model": fields.pop("model"),
            "messages": {"type": "array", "minItems": 1, "items": message},
            **fields,
            "max_completion_tokens": {**fields["max_tokens"], "description": "Newer clients' name for max_tokens."},
            "logprobs": _optional({"type": "boolean", "description": "Return each token's log-probability."}),
            "top_logprobs": _int(0, MAX_TOP_LOGPROBS, "Only with logprobs: true. Alternatives per token."),
        },
    }


def completion_request_schema(config: GatewayConfig) -> dict[str, Any]:
    fields = _common_fields(config)
    text = {"type": "string", "minLength": 1, "maxLength": config.max_prompt_chars}
    return {
        "type": "object", "required": ["model", "prompt"], "additionalProperties": False,
        "properties": {
            "model": fields.pop("model"),
            "prompt": {"anyOf": [text, {"type": "array", "items": text, "minItems": 1, "maxItems": 1}],
                       "description": "The text to continue (a batch of one is accepted)."},
            **fields,
            "logprobs": _int(0, MAX_COMPLETION_LOGPROBS, "Each token's log-probability and this many alternatives."),
        },
    }


def classify_request_schema(config: GatewayConfig) -> dict[str, Any]:
    """vLLM's and SGLang's /classify body: texts, or one chat prompt as chat completions take it."""
    chat = chat_request_schema(config)["properties"]
    text = {"type": "string", "minLength": 1, "maxLength": config.max_prompt_chars}
    return {
        "type": "object", "required": ["model"], "additionalProperties": False,
        # Refused in code first (gateway/classify.py), in words; declared here for the document.
        "oneOf": [{"required": ["input"]}, {"required": ["messages"]}],
        "description": "input or messages, not both. Each input is answered by the adapter's task head after one "
                       "pass over it (docs/task-heads.md).",
        "properties": {
            "model": {**chat["model"], "description": "An adapter with a task head, as GET /v1/models lists it."},
            "input": {"anyOf": [text, {"type": "array", "items": text, "minItems": 1, "maxItems": MAX_CLASSIFY_INPUTS}],
                      "description": "A text, or texts answered in order."},
            "messages": {**chat["messages"], "description": "One chat prompt, as /v1/chat/completions takes it."},
            "tessera_slo": _slo(("ttft_ms",)),  # a head answer is one pass: no output tokens to pace
        },
    }


REQUEST_SCHEMAS = {"ChatCompletionRequest": chat_request_schema, "CompletionRequest": completion_request_schema,
                   "ClassifyRequest": classify_request_schema}


_VALIDATORS: dict[tuple[str, str], jsonschema.Draft202012Validator] = {}  # (schema name, repr(config)) ->


def _validator(name: str, config: GatewayConfig) -> jsonschema.Draft202012Validator:
    key = (name, repr(config))  # the schemas read the config's limits
    if key not in _VALIDATORS:
        _VALIDATORS[key] = jsonschema.Draft202012Validator(REQUEST_SCHEMAS[name](config))
    return _VALIDATORS[key]


def check_body(body: Any, name: str, config: GatewayConfig) -> dict[str, Any]:
    """`body` (from parse_json) checked against REQUEST_SCHEMAS[name]; InvalidArgument naming the
    first offending field otherwise."""
    if not isinstance(body, dict):
        raise InvalidArgument(f"the request body must be a JSON object, got {_shown(body)}")
    validator = _validator(name, config)
    errors = list(validator.iter_errors(body))
    if errors:
        # The shallowest first: a missing model before a bad max_tokens before a bad messages[3].role.
        raise _invalid(_specific(min(errors, key=lambda e: len(e.absolute_path))))
    return body


# Errors, worded from the schema that failed.

def _specific(error: ValidationError) -> ValidationError:
    """Into an anyOf only where one alternative has the value's type: a list given for `content`
    is wrong in the list's terms; a number given for it is wrong for both alternatives."""
    while error.validator == "anyOf":
        branches = error.schema["anyOf"]
        typed = [i for i, branch in enumerate(branches) if _is_type(error.instance, branch.get("type"))]
        if len(typed) != 1:
            break
        inner = [e for e in error.context or [] if e.relative_schema_path[0] == typed[0]]
        if not inner:
            break
        error = min(inner, key=lambda e: len(e.absolute_path))
    return error


def _is_type(value: Any, type_: str | None) -> bool:
    return type_ is not None and jsonschema.Draft202012Validator.TYPE_CHECKER.is_type(value, type_)


def _invalid(error: ValidationError) -> InvalidArgument:
    path = list(error.absolute_path)
    schema, value, keyword = error.schema, error.instance, error.validator
    if keyword == "required":
        missing = next(name for name in error.validator_value if name not in value)
        param = param_name([*path, missing])
        return InvalidArgument(f"{param} is required", param=param)
    param = param_name(path)
    if keyword == "additionalProperties":
        unknown = sorted(set(value) - set(schema.get("properties", {})))
        if not path:  # the body's own fields: OpenAI's wording, the first one named as the param
            return _unknown_argument(unknown[0], schema)
        return InvalidArgument(f"{param} has unknown fields {unknown}; known: {', '.join(schema['properties'])}",
                               param=param)
    if keyword == "maxLength":
        return InvalidArgument(f"{param} is too long: {len(value)} characters, the limit is {error.validator_value}",
                               param=param)
    if keyword == "maxItems" and schema.get("minItems") != error.validator_value:
        return InvalidArgument(f"{param} accepts at most {error.validator_value} items, got {len(value)}", param=param)
    return InvalidArgument(f"{param} must be {expected(schema)}, got {_shown(value)}", param=param)


def _unknown_argument(name: str, schema: dict[str, Any]) -> InvalidArgument:
    if name in OPENAI_UNSUPPORTED:
        return InvalidArgument(f"{name} is an OpenAI parameter that Tessera does not support yet; leave it out",
                               param=name)
    return InvalidArgument(f"unrecognized request argument supplied: {name}; the accepted ones are "
                           f"{', '.join(schema['properties'])} (GET /openapi.json describes them)", param=name)


_NOUNS = {"integer": ("an integer", "integers"), "number": ("a number", "numbers"), "string": ("a string", "strings"),
          "boolean": ("a boolean", "booleans"), "object": ("an object", "objects"), "array": ("a list", "lists")}


def expected(schema: dict[str, Any], plural: bool = False) -> str:
    """What a schema accepts, in words: "an integer between 1 and 64", "a non-empty string or a list
    of non-empty strings", "one of 'system', 'user', 'assistant'"."""
    if "anyOf" in schema:
        return " or ".join(expected(branch, plural) for branch in schema["anyOf"] if branch.get("type") != "null")
    if "enum" in schema:
        return "one of " + ", ".join(_shown(v) for v in schema["enum"] if v is not None)
    types = schema.get("type", [])
    type_ = next((t for t in ([types] if isinstance(types, str) else types) if t != "null"), None)
    if type_ is None:
        return "values" if plural else "a valid value"
    if "title" in schema:
        return f"{schema['title']}s" if plural else f"a {schema['title']}"
    noun = _NOUNS[type_][plural]
    low, high, above = schema.get("minimum"), schema.get("maximum"), schema.get("exclusiveMinimum")
    if low is not None and low == high:
        return _number(low)
    if low is not None and high is not None:
        return f"{noun} between {_number(low)} and {_number(high)}"
    if above is not None and high is not None:
        return f"{noun} in ({_number(above)}, {_number(high)}]"
    if type_ == "string" and schema.get("minLength", 0) >= 1:
        return "non-empty strings" if plural else "a non-empty string"
    if type_ == "array":
        count, one = schema.get("minItems", 0), schema.get("minItems") == schema.get("maxItems") == 1
        items = expected(schema["items"], plural=not one) if "items" in schema else "values"
        if one:
            return f"a list of one {items.removeprefix('a ').removeprefix('an ')}"
        return f"a non-empty list of {items}" if count >= 1 else f"a list of {items}"
    return noun


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def _shown(value: Any) -> str:
    if isinstance(value, str):
        value = value[:MAX_SHOWN_CHARS]  # a prompt may be a megabyte
    text = json.dumps(value, ensure_ascii=True) if not isinstance(value, (dict, list)) else _kind(value)
    return text if len(text) <= MAX_SHOWN_CHARS else text[:MAX_SHOWN_CHARS] + "..."


def _kind(value: dict[str, Any] | list[Any]) -> str:
    """A container is named, not printed (it may be large): "a list with 3 items"."""
    count, noun = len(value), "field" if isinstance(value, dict) else "item"
    return f"{'an object' if noun == 'field' else 'a list'} with {count} {noun}{'' if count == 1 else 's'}"
