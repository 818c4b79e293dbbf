"""Request validation shared by both front doors (REST and gRPC).

Two steps, one set of rules:
- `parse_chat_request` / `parse_completion_request` turn an OpenAI-style JSON body into an
  `ApiRequest` (the `GenerateRequest` proto plus the REST-only options). They check JSON types
  and every range before a value enters the proto, since a proto field would overflow or
  wrap (max_tokens=2**40 in an int32, seed=-1 in a uint64).
- `validate_generate_request` checks a `GenerateRequest` from either door and fills defaults.
  Proto zero values mean "default" there (top_p 0 -> 1.0, max_tokens 0 -> the configured
  default), so the same range checks run only on the fields that are set.

Every failure is an `InvalidArgument` whose `param` names the offending field, so REST
answers 400 and gRPC INVALID_ARGUMENT with the same message. Unknown JSON fields are
ignored, as OpenAI does; `tessera_slo` ({"tpot_ms": 50, "ttft_ms": 2000}) is ours: the latency
objectives routing places the request by (docs/routing.md).
"""

from __future__ import annotations

import dataclasses
import math
import uuid
from typing import Any, Mapping

from services.common.config import GatewayConfig
from services.common.errors import InvalidArgument
from tessera.v1 import common_pb2, inference_pb2

from gateway.images import check_chat_images, check_image, check_image_count, image_from_url

CHAT_ROLES = frozenset({"system", "user", "assistant"})
MAX_STOP_SEQUENCES = 4
MAX_STOP_TOKEN_IDS = 64
MAX_TOKEN_ID = 2**31 - 1  # SamplingParams.stop_token_ids are int32; the worker checks its vocabulary
MAX_TEMPERATURE = 2.0
MAX_SEED = 2**64 - 1  # SamplingParams.seed is a uint64
MAX_TOP_LOGPROBS = 20  # chat's top_logprobs, and the most a worker returns (either door)
MAX_COMPLETION_LOGPROBS = 5  # /v1/completions' logprobs, OpenAI's limit for the legacy API
MAX_SLO_MS = 3_600_000.0
SLO_FIELDS = ("tpot_ms", "ttft_ms")


@dataclasses.dataclass(frozen=True, slots=True)
class ApiRequest:
    """A validated OpenAI-style request: what to generate plus how to answer over HTTP."""

    generate: inference_pb2.GenerateRequest
    stream: bool
    include_usage: bool  # stream_options.include_usage: one extra chunk with the usage


# Range checks shared by both doors.

def check_max_tokens(value: int, config: GatewayConfig, param: str = "max_tokens") -> None:
    if not 1 <= value <= config.max_tokens_limit:
        raise InvalidArgument(
            f"{param} must be an integer between 1 and {config.max_tokens_limit}, got {value}", param=param)


def check_temperature(value: float) -> None:
    if not 0.0 <= value <= MAX_TEMPERATURE:  # also rejects NaN
        raise InvalidArgument(f"temperature must be between 0 and {MAX_TEMPERATURE:g}, got {value}",
                              param="temperature")


def check_top_p(value: float) -> None:
    if not 0.0 < value <= 1.0:
        raise InvalidArgument(f"top_p must be in (0, 1], got {value}", param="top_p")


def check_top_k(value: int) -> None:
    if value < 0:
        raise InvalidArgument(f"top_k must be a non-negative integer, got {value}", param="top_k")


def check_stop(stop: list[str]) -> None:
    if len(stop) > MAX_STOP_SEQUENCES:
        raise InvalidArgument(f"stop accepts at most {MAX_STOP_SEQUENCES} sequences, got {len(stop)}",
                              param="stop")
    if any(not s for s in stop):
        raise InvalidArgument("stop sequences must be non-empty strings", param="stop")


def check_stop_token_ids(ids: list[int]) -> None:
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidArgument(f"stop_token_ids accepts at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}",
                              param="stop_token_ids")
    for i, token_id in enumerate(ids):
        if not 0 <= token_id <= MAX_TOKEN_ID:
            raise InvalidArgument(f"stop_token_ids[{i}] must be a token id between 0 and {MAX_TOKEN_ID}, "
                                  f"got {token_id}", param="stop_token_ids")


def check_logprobs(value: int, limit: int, param: str) -> None:
    if not 0 <= value <= limit:
        raise InvalidArgument(f"{param} must be an integer between 0 and {limit}, got {value}", param=param)


def check_role(role: str, param: str) -> None:
    if role not in CHAT_ROLES:
        raise InvalidArgument(f"{param} must be one of {sorted(CHAT_ROLES)}, got {role!r}", param=param)


def check_prompt_chars(chars: int, config: GatewayConfig, param: str) -> None:
    if chars > config.max_prompt_chars:
        raise InvalidArgument(f"{param} is too long: {chars} characters, the limit is {config.max_prompt_chars}",
                              param=param)


def check_slo_ms(value: float, param: str) -> None:
    if not (math.isfinite(value) and 0 < value <= MAX_SLO_MS):
        raise InvalidArgument(f"{param} must be a number of milliseconds in (0, {MAX_SLO_MS:.0f}], got {value}",
                              param=param)


def validate_generate_request(request: inference_pb2.GenerateRequest,
                              config: GatewayConfig) -> inference_pb2.GenerateRequest:
    """Check a request from either door; return a copy with max_tokens filled in."""
    if not request.model:
        raise InvalidArgument("model is required", param="model")
    kind = request.WhichOneof("prompt")
    if kind is None:
        raise InvalidArgument("a prompt is required (text or chat messages)", param="prompt")
    if kind == "text":
        if not request.text:
            raise InvalidArgument("prompt must be a non-empty string", param="prompt")
        check_prompt_chars(len(request.text), config, "prompt")
    else:
        if not request.chat.messages:
            raise InvalidArgument("messages must hold at least one message", param="messages")
        for i, message in enumerate(request.chat.messages):
            check_role(message.role, f"messages[{i}].role")
            if message.content and message.parts:
                raise InvalidArgument(f"messages[{i}] has both content and parts; send one of them",
                                      param=f"messages[{i}]")
        check_prompt_chars(chat_text_chars(request.chat), config, "messages")
        check_chat_images(request.chat, config)
    sampling = request.sampling
    if sampling.max_tokens != 0:
        check_max_tokens(sampling.max_tokens, config)
    check_temperature(sampling.temperature)
    if sampling.top_p != 0.0:
        check_top_p(sampling.top_p)
    check_top_k(sampling.top_k)
    check_stop(list(sampling.stop))
    check_stop_token_ids(list(sampling.stop_token_ids))
    if sampling.HasField("logprobs"):
        check_logprobs(sampling.logprobs, MAX_TOP_LOGPROBS, "logprobs")
    for field in SLO_FIELDS:  # 0: the gateway's default
        if (value := getattr(request.slo, field)) != 0:
            check_slo_ms(value, f"slo.{field}")
    checked = inference_pb2.GenerateRequest()
    checked.CopyFrom(request)
    if sampling.max_tokens == 0:
        checked.sampling.max_tokens = config.default_max_tokens
    return checked


# JSON field readers: type checks with the parameter's name in the message.

def _int(body: Mapping[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"{key} must be an integer, got {value!r}", param=key)
    return value


def _number(body: Mapping[str, Any], key: str) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidArgument(f"{key} must be a number, got {value!r}", param=key)
    return float(value)


def _bool(body: Mapping[str, Any], key: str) -> bool:
    value = body.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise InvalidArgument(f"{key} must be a boolean, got {value!r}", param=key)
    return value


def _stop(body: Mapping[str, Any]) -> list[str]:
    value = body.get("stop")
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise InvalidArgument("stop must be a string or a list of strings", param="stop")
    check_stop(value)
    return value


def _stop_token_ids(body: Mapping[str, Any]) -> list[int]:
    """vLLM's extension field: a list of token ids that end generation like EOS."""
    value = body.get("stop_token_ids")
    if value is None:
        return []
    # bool is an int subclass: `true` is not token id 1.
    if not isinstance(value, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in value):
        raise InvalidArgument("stop_token_ids must be a list of integers", param="stop_token_ids")
    check_stop_token_ids(value)
    return value


def _chat_logprobs(body: Mapping[str, Any]) -> int | None:
    """Chat asks with `logprobs: true`, and for alternatives with `top_logprobs: 0..20`."""
    top = _int(body, "top_logprobs")
    if not _bool(body, "logprobs"):
        if top is not None:
            raise InvalidArgument("top_logprobs requires logprobs to be true", param="top_logprobs")
        return None
    if top is not None:
        check_logprobs(top, MAX_TOP_LOGPROBS, "top_logprobs")
    return top or 0


def _completion_logprobs(body: Mapping[str, Any]) -> int | None:
    """Completions ask with `logprobs: 0..5`, the number of alternatives."""
    logprobs = _int(body, "logprobs")
    if logprobs is not None:
        check_logprobs(logprobs, MAX_COMPLETION_LOGPROBS, "logprobs")
    return logprobs


def _sampling(body: Mapping[str, Any], max_tokens_key: str, logprobs: int | None,
              config: GatewayConfig) -> common_pb2.SamplingParams:
    """Unset fields stay zero: greedy decoding and the configured max_tokens by default.
    `logprobs` comes checked: its JSON differs between chat and completions."""
    sampling = common_pb2.SamplingParams()
    if logprobs is not None:
        sampling.logprobs = logprobs
    max_tokens = _int(body, max_tokens_key)
    if max_tokens is not None:
        check_max_tokens(max_tokens, config, max_tokens_key)
        sampling.max_tokens = max_tokens
    if (temperature := _number(body, "temperature")) is not None:
        check_temperature(temperature)
        sampling.temperature = temperature
    if (top_p := _number(body, "top_p")) is not None:
        check_top_p(top_p)
        sampling.top_p = top_p
    if (top_k := _int(body, "top_k")) is not None:
        check_top_k(top_k)
        sampling.top_k = top_k
    sampling.stop.extend(_stop(body))
    sampling.stop_token_ids.extend(_stop_token_ids(body))
    if (seed := _int(body, "seed")) is not None:
        if not 0 <= seed <= MAX_SEED:
            raise InvalidArgument(f"seed must be an integer between 0 and {MAX_SEED}, got {seed}", param="seed")
        sampling.seed = seed
    if (n := _int(body, "n")) is not None and n != 1:
        raise InvalidArgument(f"only n=1 is supported, got {n}", param="n")
    return sampling


def _slo(body: Mapping[str, Any]) -> inference_pb2.Slo:
    """The `tessera_slo` extension; a field left out takes the gateway's default."""
    value = body.get("tessera_slo")
    slo = inference_pb2.Slo()
    if value is None:
        return slo
    if not isinstance(value, Mapping):
        raise InvalidArgument(f'tessera_slo must be an object like {{"tpot_ms": 50, "ttft_ms": 2000}}, got {value!r}',
                              param="tessera_slo")
    unknown = sorted(set(value) - set(SLO_FIELDS))
    if unknown:
        raise InvalidArgument(f"tessera_slo has unknown fields {unknown}; known: {', '.join(SLO_FIELDS)}",
                              param="tessera_slo")
    for field in SLO_FIELDS:
        number = value.get(field)
        if number is None:
            continue
        if isinstance(number, bool) or not isinstance(number, (int, float)):
            raise InvalidArgument(f"tessera_slo.{field} must be a number, got {number!r}", param=f"tessera_slo.{field}")
        check_slo_ms(float(number), f"tessera_slo.{field}")
        setattr(slo, field, float(number))
    return slo


def _model(body: Mapping[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidArgument("model is required and must be a non-empty string", param="model")
    return model


def _stream_options(body: Mapping[str, Any]) -> tuple[bool, bool]:
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise InvalidArgument("stream_options is only allowed when stream is true", param="stream_options")
    if not isinstance(options, Mapping):
        raise InvalidArgument("stream_options must be an object", param="stream_options")
    return stream, _bool(options, "include_usage")


def chat_text_chars(chat: common_pb2.ChatPrompt) -> int:
    """The characters of a chat prompt's text, in `content` or in text parts."""
    return sum(len(m.content) + sum(len(p.text) for p in m.parts) for m in chat.messages)


def _content_part(part: Any, config: GatewayConfig, param: str) -> common_pb2.ContentPart:
    """{"type": "text", "text": ...} or {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}."""
    kind = part.get("type") if isinstance(part, Mapping) else None
    if kind == "text" and isinstance(part.get("text"), str):
        return common_pb2.ContentPart(text=part["text"])
    if kind == "image_url":
        image_url = part.get("image_url")
        url = image_url.get("url") if isinstance(image_url, Mapping) else None
        if not isinstance(url, str):
            raise InvalidArgument(f"{param} must hold image_url: {{'url': str}}", param=param)
        image = image_from_url(url, config, param)
        check_image(image, config, param)  # here too, so the error names the REST field
        return common_pb2.ContentPart(image=image)
    raise InvalidArgument(f"{param} must be a {{'type': 'text', 'text': str}} or {{'type': 'image_url', "
                          f"'image_url': {{'url': str}}}} part, got type {kind!r}", param=param)


def _message(role: str, content: Any, config: GatewayConfig, param: str) -> common_pb2.ChatMessage:
    """content: a string; a list of text parts (joined by newlines, as before images); or a list of
    text and image parts, kept in order as `parts`."""
    if isinstance(content, str):
        return common_pb2.ChatMessage(role=role, content=content)
    if not isinstance(content, list):
        raise InvalidArgument(f"{param} must be a string or a list of content parts", param=param)
    parts = [_content_part(part, config, f"{param}[{j}]") for j, part in enumerate(content)]
    if all(p.WhichOneof("part") == "text" for p in parts):
        return common_pb2.ChatMessage(role=role, content="\n".join(p.text for p in parts))
    return common_pb2.ChatMessage(role=role, parts=parts)


def _image_part_count(messages: list[Any]) -> int:
    return sum(1 for message in messages if isinstance(message, Mapping) and isinstance(message.get("content"), list)
               for part in message["content"] if isinstance(part, Mapping) and part.get("type") == "image_url")


def _messages(body: Mapping[str, Any], config: GatewayConfig) -> common_pb2.ChatPrompt:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidArgument("messages must be a non-empty list of messages", param="messages")
    check_image_count(_image_part_count(messages), config)  # before any image is decoded or downloaded
    chat = common_pb2.ChatPrompt()
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidArgument(f"messages[{i}] must be an object with role and content", param=f"messages[{i}]")
        role = message.get("role")
        if not isinstance(role, str):
            raise InvalidArgument(f"messages[{i}].role must be a string", param=f"messages[{i}].role")
        check_role(role, f"messages[{i}].role")
        chat.messages.append(_message(role, message.get("content"), config, f"messages[{i}].content"))
    return chat


def _prompt(body: Mapping[str, Any]) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:  # OpenAI accepts a batch; we accept a batch of one
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise InvalidArgument("prompt must be a non-empty string", param="prompt")
    return prompt


def _request_id() -> str:
    return uuid.uuid4().hex


def parse_chat_request(body: Any, config: GatewayConfig) -> ApiRequest:
    """Validate a /v1/chat/completions body."""
    body = _object(body)
    # Newer OpenAI clients send max_completion_tokens; older ones max_tokens.
    max_tokens_key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    request = inference_pb2.GenerateRequest(
        model=_model(body), chat=_messages(body, config),
        sampling=_sampling(body, max_tokens_key, _chat_logprobs(body), config),
        request_id=_request_id(), slo=_slo(body))
    stream, include_usage = _stream_options(body)
    return ApiRequest(validate_generate_request(request, config), stream, include_usage)


def parse_completion_request(body: Any, config: GatewayConfig) -> ApiRequest:
    """Validate a /v1/completions body."""
    body = _object(body)
    request = inference_pb2.GenerateRequest(
        model=_model(body), text=_prompt(body),
        sampling=_sampling(body, "max_tokens", _completion_logprobs(body), config),
        request_id=_request_id(), slo=_slo(body))
    stream, include_usage = _stream_options(body)
    return ApiRequest(validate_generate_request(request, config), stream, include_usage)


def _object(body: Any) -> Mapping[str, Any]:
    if not isinstance(body, Mapping):
        raise InvalidArgument("the request body must be a JSON object")
    return body
