"""Classify requests: the rules both doors share for answers from an adapter's task head (docs/task-heads.md).

A ClassifyRequest holds 1 to MAX_CLASSIFY_INPUTS inputs, each a text or a chat prompt. Each is checked as a
generate request's prompt is (validate_generate_request: one set of rules for both) and becomes one worker
request, priced by routing as a prompt with one output token. The REST body, vLLM's and SGLang's /classify
shape, becomes the same ClassifyRequest:

    {"model": "sentiment", "input": ["great", "awful"]}     -> two text inputs, answered in order
    {"model": "detector", "messages": [{"role": "user", "content": [...image...]}]}  -> one chat input

A head answers in place of the LM head: a head adapter is asked only to classify, and only a head adapter is.
"""

from __future__ import annotations

from typing import Any

from services.common.config import GatewayConfig
from services.common.errors import InvalidArgument
from services.common.task_heads import TaskHead, task_head_from_record
from tessera.v1 import common_pb2, inference_pb2

from gateway.registry_cache import ResolvedModel
from gateway.rest_schema import MAX_CLASSIFY_INPUTS, check_body
from gateway.schemas import parse_chat_prompt, validate_generate_request

PROMPT_PARAMS = ("prompt", "messages")  # what validate_generate_request names for an input's own faults
HEAD_DOCS = "docs/task-heads.md"


def validate_classify_request(request: inference_pb2.ClassifyRequest,
                              config: GatewayConfig) -> list[inference_pb2.GenerateRequest]:
    """Each input as a checked GenerateRequest of the request's model and SLO, with max_tokens 1: what routing
    prices as its output. With several inputs, an input's fault names it: "inputs[2]: prompt must be ..."."""
    if not 1 <= len(request.inputs) <= MAX_CLASSIFY_INPUTS:
        raise InvalidArgument(f"inputs must hold 1 to {MAX_CLASSIFY_INPUTS} inputs, got {len(request.inputs)}",
                              param="inputs")
    if request.slo.tpot_ms != 0:
        raise InvalidArgument("slo.tpot_ms does not apply to classify (a head answers after one pass): set "
                              "ttft_ms only", param="slo.tpot_ms")
    prompts = []
    for i, item in enumerate(request.inputs):
        prompt = inference_pb2.GenerateRequest(model=request.model, slo=request.slo,
                                               sampling=common_pb2.SamplingParams(max_tokens=1))
        if item.WhichOneof("prompt") == "text":
            prompt.text = item.text
        elif item.WhichOneof("prompt") == "chat":
            prompt.chat.CopyFrom(item.chat)
        try:
            prompts.append(validate_generate_request(prompt, config))
        except InvalidArgument as exc:
            if len(request.inputs) == 1 or not (exc.param or "").startswith(PROMPT_PARAMS):
                raise
            raise type(exc)(f"inputs[{i}]: {exc.message}", param=f"inputs[{i}].{exc.param}") from None
    return prompts


def require_task_head(model: str, resolved: ResolvedModel) -> TaskHead:
    """The head classify answers with; InvalidArgument for a base model or an adapter without one."""
    if resolved.adapter is None:
        raise InvalidArgument(f"model '{model}' is a base model, which has no task head; classify needs an adapter "
                              f"with one ({HEAD_DOCS})", param="model")
    head = task_head_from_record(resolved.adapter.task_head_json)
    if head is None:
        raise InvalidArgument(f"adapter '{model}' has no task head; classify needs an adapter with one "
                              f"({HEAD_DOCS})", param="model")
    return head


def refuse_task_head(resolved: ResolvedModel) -> None:
    """Generation's converse rule: a head adapter answers classify only."""
    if resolved.adapter is not None and resolved.adapter.task_head_json:
        head = task_head_from_record(resolved.adapter.task_head_json)
        assert head is not None
        raise InvalidArgument(f"adapter '{resolved.adapter.name}' has a task head (kind {head.kind}): ask "
                              "POST /v1/classify (gRPC Classify)", param="model")


def parse_classify_request(body: Any, config: GatewayConfig) -> inference_pb2.ClassifyRequest:
    """Validate a /v1/classify body: `input` (a text or texts) or `messages` (one chat prompt)."""
    # Before the schema's own check of the rule (its oneOf), whose failure reads in no words of the fields.
    given = [field for field in ("input", "messages") if isinstance(body, dict) and field in body]
    if isinstance(body, dict) and not given:
        raise InvalidArgument("input (a text or a list of texts) or messages (a chat prompt) is required",
                              param="input")
    if len(given) == 2:
        raise InvalidArgument("input and messages are exclusive: send texts as input or one chat prompt as "
                              "messages", param="messages")
    body = check_body(body, "ClassifyRequest", config)
    request = inference_pb2.ClassifyRequest(model=body["model"])
    if given == ["messages"]:  # parsed only now: its images are decoded (or fetched)
        request.inputs.add(chat=parse_chat_prompt(body, config))
    else:
        texts = body["input"]
        request.inputs.extend(inference_pb2.ClassifyInput(text=text)
                              for text in ([texts] if isinstance(texts, str) else texts))
    if (ttft_ms := (body.get("tessera_slo") or {}).get("ttft_ms")) is not None:
        request.slo.ttft_ms = ttft_ms
    validate_classify_request(request, config)  # here too, so a bad request is refused on the handler's thread
    return request
