"""Request validation shared by both front doors (REST and gRPC).

Two steps, one set of rules:
- `parse_chat_request` / `parse_completion_request` check an OpenAI-style JSON body against its
  declared schema (gateway/rest_schema.py, also published at /openapi.json), then apply the
  rules across fields and turn it into an `ApiRequest` (the `GenerateRequest` proto plus the
  REST-only options). The schema bounds every number to what its proto field holds, so nothing
  overflows or wraps on the way in (max_tokens=2**40 in an int32, seed=-1 in a uint64).
- `validate_generate_request` checks a `GenerateRequest` from either door and fills defaults.
  Proto zero values mean "default" there (top_p 0 -> 1.0, max_tokens 0 -> the configured
  default), so the same range checks run only on the fields that are set.

Every failure is an `InvalidArgument` whose `param` names the offending field, so REST
answers 400 and gRPC INVALID_ARGUMENT with the same message. An unknown JSON field is a 400 naming
it, as OpenAI answers ("unrecognized request argument supplied"): a typo ("max_token") is never
served as if it were not there; OpenAI's parameters not served yet are named as such, and those
taken at their neutral value only (presence_penalty 0, logit_bias {}) are 400s at any other.
`tessera_slo` ({"tpot_ms": 50, "ttft_ms": 2000}) is ours: the latency objectives routing places the
request by (docs/routing.md).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from services.common.config import GatewayConfig
from services.common.errors import InvalidArgument
from services.common.slo import check_slo_ms
from tessera.v1 import common_pb2, inference_pb2

from gateway.images import (check_chat_images, check_image, check_image_count, check_video_file, check_video_options,
                            image_from_url, video_from_url)
from gateway.rest_schema import (
    CHAT_ROLES,
    MAX_INT32,
    MAX_MODEL_CHARS,
    MAX_STOP_CHARS,
    MAX_STOP_SEQUENCES,
    MAX_STOP_TOKEN_IDS,
    MAX_TEMPERATURE,
    MAX_TOP_LOGPROBS,
    check_body,
)

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
    if value < 0:  # its proto field is an int32: never above MAX_INT32
        raise InvalidArgument(f"top_k must be an integer between 0 and {MAX_INT32}, got {value}", param="top_k")


def check_stop(stop: list[str]) -> None:
    if len(stop) > MAX_STOP_SEQUENCES:
        raise InvalidArgument(f"stop accepts at most {MAX_STOP_SEQUENCES} sequences, got {len(stop)}",
                              param="stop")
    for i, sequence in enumerate(stop):
        if not 1 <= len(sequence) <= MAX_STOP_CHARS:
            raise InvalidArgument(f"stop[{i}] must be a non-empty string of at most {MAX_STOP_CHARS} characters, "
                                  f"got {len(sequence)} characters", param=f"stop[{i}]")


def check_stop_token_ids(ids: list[int]) -> None:
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidArgument(f"stop_token_ids accepts at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}",
                              param="stop_token_ids")
    for i, token_id in enumerate(ids):
        if token_id < 0:  # an int32 field: never above MAX_INT32; the worker checks its vocabulary
            raise InvalidArgument(f"stop_token_ids[{i}] must be an integer between 0 and {MAX_INT32}, "
                                  f"got {token_id}", param=f"stop_token_ids[{i}]")


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


def validate_generate_request(request: inference_pb2.GenerateRequest,
                              config: GatewayConfig) -> inference_pb2.GenerateRequest:
    """Check a request from either door; return a copy with max_tokens filled in."""
    if not request.model:
        raise InvalidArgument("model is required", param="model")
    if len(request.model) > MAX_MODEL_CHARS:
        raise InvalidArgument(f"model is too long: {len(request.model)} characters, the limit is {MAX_MODEL_CHARS}",
                              param="model")
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


# Checked JSON bodies -> protos. Types and ranges hold here (check_body); null means left out.

def _sampling(body: dict[str, Any], max_tokens_key: str, logprobs: int | None) -> common_pb2.SamplingParams:
    """Unset fields stay zero: greedy decoding and the configured max_tokens by default.
    `logprobs` comes checked: its JSON differs between chat and completions."""
    sampling = common_pb2.SamplingParams()
    if logprobs is not None:
        sampling.logprobs = logprobs
    # JSON Schema's integers include 5.0: int() makes them proto integers.
    if (max_tokens := body.get(max_tokens_key)) is not None:
        sampling.max_tokens = int(max_tokens)
    if (temperature := body.get("temperature")) is not None:
        sampling.temperature = temperature
    if (top_p := body.get("top_p")) is not None:
        sampling.top_p = top_p
    if (top_k := body.get("top_k")) is not None:
        sampling.top_k = int(top_k)
    if (seed := body.get("seed")) is not None:
        sampling.seed = int(seed)
    stop = body.get("stop") or []
    sampling.stop.extend([stop] if isinstance(stop, str) else stop)
    sampling.stop_token_ids.extend(int(t) for t in body.get("stop_token_ids") or [])
    return sampling


def _chat_logprobs(body: dict[str, Any]) -> int | None:
    """Chat asks with `logprobs: true`, and for alternatives with `top_logprobs: 0..20`."""
    top = body.get("top_logprobs")
    if not body.get("logprobs"):
        if top is not None:
            raise InvalidArgument("top_logprobs requires logprobs to be true", param="top_logprobs")
        return None
    return int(top or 0)


def _completion_logprobs(body: dict[str, Any]) -> int | None:
    """Completions ask with `logprobs: 0..5`, the number of alternatives."""
    logprobs = body.get("logprobs")
    return None if logprobs is None else int(logprobs)


def _slo(body: dict[str, Any]) -> inference_pb2.Slo:
    """The `tessera_slo` extension; a field left out takes the gateway's default."""
    slo = inference_pb2.Slo()
    for field, value in (body.get("tessera_slo") or {}).items():
        if value is not None:
            setattr(slo, field, value)
    return slo


def _stream_options(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = bool(body.get("stream"))
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise InvalidArgument("stream_options is only allowed when stream is true", param="stream_options")
    return stream, bool(options.get("include_usage"))


def chat_text_chars(chat: common_pb2.ChatPrompt) -> int:
    """The characters of a chat prompt's text, in `content` or in text parts."""
    return sum(len(m.content) + sum(len(p.text) for p in m.parts) for m in chat.messages)


def _content_part(part: dict[str, Any], config: GatewayConfig, param: str) -> common_pb2.ContentPart:
    """{"type": "text", "text": ...}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}},
    {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,...", "fps": 2.0, "max_frames": 16}} or
    {"type": "video", "video": [frame URLs, in time order]}. Checked here too, so errors name the REST field."""
    if part["type"] == "text":
        return common_pb2.ContentPart(text=part["text"])
    if part["type"] == "image_url":
        image = image_from_url(part["image_url"]["url"], config, param)
        check_image(image, config, param)
        return common_pb2.ContentPart(image=image)
    if part["type"] == "video":
        frames = [image_from_url(url, config, f"{param}.video[{k}]") for k, url in enumerate(part["video"])]
        for k, frame in enumerate(frames):
            check_image(frame, config, f"{param}.video[{k}]")
        return common_pb2.ContentPart(video=common_pb2.VideoPart(frames=common_pb2.VideoFrames(images=frames)))
    options = part["video_url"]
    video = common_pb2.VideoPart(fps=options.get("fps") or 0.0, max_frames=int(options.get("max_frames") or 0))
    check_video_options(video, f"{param}.video_url")
    video.file = video_from_url(options["url"], config, f"{param}.video_url.url")
    check_video_file(video.file, config, f"{param}.video_url.url")
    return common_pb2.ContentPart(video=video)


def _message(message: dict[str, Any], config: GatewayConfig, param: str) -> common_pb2.ChatMessage:
    """content: a string; a list of text parts (joined by newlines, as before images); or a list of
    text, image and video parts, kept in order as `parts`."""
    role, content = message["role"], message["content"]
    if isinstance(content, str):
        return common_pb2.ChatMessage(role=role, content=content)
    parts = [_content_part(part, config, f"{param}.content[{j}]") for j, part in enumerate(content)]
    if all(p.WhichOneof("part") == "text" for p in parts):
        return common_pb2.ChatMessage(role=role, content="\n".join(p.text for p in parts))
    return common_pb2.ChatMessage(role=role, parts=parts)


def _messages(body: dict[str, Any], config: GatewayConfig) -> common_pb2.ChatPrompt:
    messages = body["messages"]
    images = sum(1 if part["type"] == "image_url" else len(part["video"]) if part["type"] == "video" else 0
                 for m in messages if isinstance(m["content"], list) for part in m["content"])
    check_image_count(images, config)  # before any image (or video frame) is decoded or downloaded
    return common_pb2.ChatPrompt(messages=[_message(m, config, f"messages[{i}]") for i, m in enumerate(messages)])


def _prompt(body: dict[str, Any]) -> str:
    prompt = body["prompt"]
    return prompt if isinstance(prompt, str) else prompt[0]  # OpenAI accepts a batch; we accept a batch of one


def parse_chat_request(body: Any, config: GatewayConfig) -> ApiRequest:
    """Validate a /v1/chat/completions body."""
    body = check_body(body, "ChatCompletionRequest", config)
    # Newer OpenAI clients send max_completion_tokens; older ones max_tokens.
    max_tokens_key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    request = inference_pb2.GenerateRequest(
        model=body["model"], chat=_messages(body, config),
        sampling=_sampling(body, max_tokens_key, _chat_logprobs(body)), slo=_slo(body))
    stream, include_usage = _stream_options(body)
    return ApiRequest(validate_generate_request(request, config), stream, include_usage)


def parse_completion_request(body: Any, config: GatewayConfig) -> ApiRequest:
    """Validate a /v1/completions body."""
    body = check_body(body, "CompletionRequest", config)
    request = inference_pb2.GenerateRequest(
        model=body["model"], text=_prompt(body),
        sampling=_sampling(body, "max_tokens", _completion_logprobs(body)), slo=_slo(body))
    stream, include_usage = _stream_options(body)
    return ApiRequest(validate_generate_request(request, config), stream, include_usage)


def parse_chat_prompt(body: dict[str, Any], config: GatewayConfig) -> common_pb2.ChatPrompt:
    """A checked body's `messages` (check_body), parsed as chat completions parse them, images included: for
    the other endpoints that take a chat prompt (/v1/classify)."""
    return _messages(body, config)
