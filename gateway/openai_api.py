"""The OpenAI-compatible REST blueprint: /v1/chat/completions, /v1/completions, /v1/models, and vLLM's
/v1/classify (answers from an adapter's task head).

Responses follow OpenAI's objects so the official clients work unchanged. A stream is SSE:
`data: {chunk}\\n\\n` per chunk, then `data: [DONE]\\n\\n`. A failure before the first token is
a plain JSON error with its status code (the stream has not started); after it, one
`data: {"error": {...}}` event ends the stream, which the openai client raises as APIError.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from flask import Blueprint, Response, current_app, jsonify, request

from services.common.config import GatewayConfig
from services.common.errors import Internal, TesseraError
from services.common.flask_asgi import Head, LoopResponse
from tessera.v1 import common_pb2, inference_pb2

from gateway.bridge import CoreBridge
from gateway.classify import parse_classify_request
from gateway.http_errors import error_body
from gateway.logprobs import chat_logprobs, completion_logprobs
from gateway.metrics import REQUESTS
from gateway.rest_schema import parse_json
from gateway.schemas import ApiRequest, parse_chat_request, parse_completion_request

log = logging.getLogger(__name__)

bp = Blueprint("openai", __name__, url_prefix="/v1")

CORE_KEY = "tessera.core"
CONFIG_KEY = "tessera.gateway_config"

FINISH_REASONS = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length"}


@dataclasses.dataclass(frozen=True, slots=True)
class Shape:
    """What differs between chat and text completions; everything else is shared."""

    id_prefix: str
    object: str
    chunk_object: str
    chat: bool

    def choice(self, text: str, finish_reason: str, logprobs: dict[str, Any] | None) -> dict[str, Any]:
        body = {"message": {"role": "assistant", "content": text}} if self.chat else {"text": text}
        return {"index": 0, **body, "logprobs": logprobs, "finish_reason": finish_reason}

    def chunk_choice(self, delta: dict[str, str], finish_reason: str | None,
                     logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        # delta: {"role": ...} / {"content": ...} / {} for chat; text chunks carry {"text": ...}.
        body = {"delta": delta} if self.chat else {"text": delta.get("content", "")}
        return {"index": 0, **body, "logprobs": logprobs, "finish_reason": finish_reason}

    def logprobs(self, entries: list[common_pb2.TokenLogprob], text_offsets: list[int]) -> dict[str, Any]:
        return chat_logprobs(entries) if self.chat else completion_logprobs(entries, text_offsets)


CHAT = Shape("chatcmpl-", "chat.completion", "chat.completion.chunk", chat=True)
TEXT = Shape("cmpl-", "text_completion", "text_completion", chat=False)


@dataclasses.dataclass(frozen=True, slots=True)
class Reply:
    """One request's answer: the fields every object and chunk repeats."""

    shape: Shape
    api: ApiRequest
    created: int
    # The gateway's id for the request, which its gRPC responses and the worker's traffic carry: the
    # core assigns it, so it is known from the first response on (`with_id`); the REST `id` derives from it.
    request_id: str = ""

    def with_id(self, first: common_pb2.GenerateResponse) -> Reply:
        return dataclasses.replace(self, request_id=first.request_id)

    def head(self, obj: str) -> dict[str, Any]:
        assert self.request_id, "the id is the gateway's, known from the first response"
        return {"id": self.shape.id_prefix + self.request_id, "object": obj,
                "created": self.created, "model": self.api.generate.model}

    def logprobs(self, deltas: Sequence[common_pb2.TokenDelta], start: int = 0) -> dict[str, Any] | None:
        """The logprobs object of consecutive deltas whose text begins at character `start` of the
        completion; None when the request did not ask for log-probabilities."""
        if not self.api.generate.sampling.HasField("logprobs"):
            return None
        entries: list[common_pb2.TokenLogprob] = []
        offsets: list[int] = []
        for delta in deltas:
            entries += delta.logprobs
            # The engine streams one token per delta, so a token's text starts where its delta's does.
            offsets += [start] * len(delta.logprobs)
            start += len(delta.text)
        return self.shape.logprobs(entries, offsets)

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> str:
        body = {**self.head(self.shape.chunk_object), "choices": choices}
        if self.api.include_usage:
            body["usage"] = usage
        return _event(body)


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def _usage(final: common_pb2.Completion) -> dict[str, int]:
    prompt, completion = final.usage.prompt_tokens, final.usage.completion_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _finish_reason(final: common_pb2.Completion) -> str:
    return FINISH_REASONS.get(final.finish_reason, "stop")


def _core() -> CoreBridge:
    return current_app.extensions[CORE_KEY]


def _config() -> GatewayConfig:
    return current_app.extensions[CONFIG_KEY]


def _json_body() -> Any:
    # Whatever the content type says (curl -d sends form-encoded types): the body is read as JSON,
    # strictly (rest_schema.parse_json), never by Flask's get_json, whose parser can overflow the stack.
    return parse_json(request.get_data(cache=False))


@bp.post("/chat/completions")
def chat_completions() -> Response:
    return _answer(Reply(CHAT, parse_chat_request(_json_body(), _config()), int(time.time())))


@bp.post("/completions")
def completions() -> Response:
    return _answer(Reply(TEXT, parse_completion_request(_json_body(), _config()), int(time.time())))


@bp.get("/models")
def list_models() -> Response:
    cards = _core().list_models()
    return jsonify({"object": "list", "data": [
        {"id": c.id, "object": "model", "created": c.created_unix, "owned_by": "tessera",
         "root": c.base_model, "parent": c.parent or None}
        for c in cards]})


@bp.post("/classify")
def classify() -> Response:
    classify_request = parse_classify_request(_json_body(), _config())
    return LoopResponse(_classified(_core(), classify_request, int(time.time()), _route())).flask()


def _route() -> str:
    return request.url_rule.rule if request.url_rule is not None else "unmatched"


def _answer(reply: Reply) -> Response:
    # Answered on the event loop: waiting for a worker's tokens holds no thread (services/common/flask_asgi.py).
    return LoopResponse(_respond(reply, _core().generate(reply.api.generate), _route())).flask()


async def _respond(reply: Reply, responses: AsyncIterator[common_pb2.GenerateResponse],
                   route: str) -> AsyncIterator[Head | bytes]:
    """On the loop. Waits for the first message before answering: validation, NOT_FOUND, overload and
    no-worker errors then get their own status code instead of a 200 stream holding an error."""
    async with contextlib.aclosing(responses):  # type: ignore[type-var]
        try:
            first = await anext(responses)
            reply = reply.with_id(first)
            whole = None if reply.api.stream else await _completion(reply, first, responses)
        except Exception as exc:
            for part in _error_parts(_as_tessera_error(exc, reply.request_id), route):
                yield part
            return
        if whole is not None:
            for part in _json_parts(route, 200, whole):
                yield part
            return
        yield _head(route, 200, [("Content-Type", "text/event-stream"), ("Cache-Control", "no-cache"),
                                 ("X-Accel-Buffering", "no")])
        async for event in _stream(reply, first, responses):
            yield event.encode()


def _head(route: str, status: int, headers: list[tuple[str, str]]) -> Head:
    REQUESTS.labels(route=route, status=str(status)).inc()  # app.py counts every other answer
    return Head(status, headers)


def _json_parts(route: str, status: int, body: dict[str, Any],
                headers: Sequence[tuple[str, str]] = ()) -> list[Head | bytes]:
    data = json.dumps(body, separators=(",", ":")).encode()
    return [_head(route, status, [("Content-Type", "application/json"), ("Content-Length", str(len(data))),
                                  *headers]), data]


def _error_parts(error: TesseraError, route: str) -> list[Head | bytes]:
    retry_after = error.retry_after_header()  # 429 and 503
    return _json_parts(route, error.http_status, error_body(error),
                       [("Retry-After", retry_after)] if retry_after is not None else [])


def _as_tessera_error(exc: Exception, request_id: str) -> TesseraError:
    if isinstance(exc, TesseraError):
        return exc
    log.exception("request %s failed", request_id or "(before the gateway's first response)")
    return Internal(f"internal error: {type(exc).__name__}")


async def _completion(reply: Reply, first: common_pb2.GenerateResponse,
                      responses: AsyncIterator[common_pb2.GenerateResponse]) -> dict[str, Any]:
    """The whole (non-streamed) completion object."""
    deltas: list[common_pb2.TokenDelta] = []
    response = first
    while response.WhichOneof("payload") != "final":
        deltas.append(response.delta)
        response = await anext(responses, None)
        if response is None:
            raise Internal(f"request {reply.request_id} ended without a final message")
    final = response.final
    return {**reply.head(reply.shape.object),
            "choices": [reply.shape.choice(final.text, _finish_reason(final), reply.logprobs(deltas))],
            "usage": _usage(final)}


async def _stream(reply: Reply, first: common_pb2.GenerateResponse,
                  responses: AsyncIterator[common_pb2.GenerateResponse]) -> AsyncIterator[str]:
    shape = reply.shape
    try:
        if shape.chat:
            yield reply.chunk([shape.chunk_choice({"role": "assistant", "content": ""}, None)])
        chars = 0  # of the completion's text streamed so far
        response: common_pb2.GenerateResponse | None = first
        while response is not None:
            if response.WhichOneof("payload") == "delta":
                delta = response.delta
                logprobs = reply.logprobs([delta], chars)
                chars += len(delta.text)
                # A token that ends mid-character decodes to "": no chunk, unless it carries logprobs.
                if delta.text or logprobs is not None:
                    yield reply.chunk([shape.chunk_choice({"content": delta.text}, None, logprobs)])
            else:
                yield reply.chunk([shape.chunk_choice({}, _finish_reason(response.final))])
                if reply.api.include_usage:
                    yield reply.chunk([], _usage(response.final))
            response = await anext(responses, None)
        yield "data: [DONE]\n\n"
    except Exception as exc:  # a client that went away cancels instead: CancelledError passes
        yield _event(error_body(_as_tessera_error(exc, reply.request_id)))


async def _classified(core: CoreBridge, classify_request: inference_pb2.ClassifyRequest, created: int,
                      route: str) -> AsyncIterator[Head | bytes]:
    """On the loop: vLLM's classification list, one item per input in order."""
    try:
        answer = await core.classify(classify_request)
    except Exception as exc:
        for part in _error_parts(_as_tessera_error(exc, ""), route):
            yield part
        return
    prompt_tokens = answer.usage.prompt_tokens
    for part in _json_parts(route, 200, {
            "id": "classify-" + answer.request_id, "object": "list", "created": created,
            "model": classify_request.model, "data": [_head_item(i, head) for i, head in enumerate(answer.results)],
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens, "completion_tokens": 0}}):
        yield part


def _head_item(index: int, head: common_pb2.HeadOutput) -> dict[str, Any]:
    if head.probs:  # a classification head; a detection head fills detections only
        return {"index": index, "label": head.label, "probs": list(head.probs), "num_classes": len(head.probs)}
    return {"index": index, "detections": [{"label": d.label, "score": d.score, "box": list(d.box)}
                                           for d in head.detections]}
