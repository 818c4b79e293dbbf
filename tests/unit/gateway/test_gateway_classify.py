"""Classify (REST POST /v1/classify, gRPC Inference.Classify) through the real gateway to fake workers that
answer head requests (gateway_fakes.fake_head_output), and the rule that head adapters only classify."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import jsonschema
import pytest
import requests

from tests.unit.gateway.gateway_fakes import ADAPTER, BASE, CLASSIFIER, DETECTOR, GatewayEnv, with_head_adapters
from tessera.v1 import common_pb2, inference_pb2, inference_pb2_grpc


@pytest.fixture
def env() -> Iterator[GatewayEnv]:
    env = with_head_adapters(GatewayEnv())
    yield env
    env.close()


def classify(env: GatewayEnv, body: dict[str, Any], headers: dict[str, str] | None = None) -> requests.Response:
    return requests.post(f"{env.http_base}/v1/classify", json=body, headers=headers, timeout=30)


def texts(*prompts: str) -> list[inference_pb2.ClassifyInput]:
    return [inference_pb2.ClassifyInput(text=p) for p in prompts]


def test_rest_classification_answers_each_input_in_order_with_usage_summed(env: GatewayEnv) -> None:
    response = classify(env, {"model": CLASSIFIER, "input": ["a", "a b", "a b c"]})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["id"].startswith("classify-") and body["object"] == "list" and body["model"] == CLASSIFIER
    assert isinstance(body["created"], int)
    # The fake head answers label (words mod 3) with probability 1.
    assert body["data"] == [
        {"index": 0, "label": "neutral", "probs": [0.0, 1.0, 0.0], "num_classes": 3},
        {"index": 1, "label": "positive", "probs": [0.0, 0.0, 1.0], "num_classes": 3},
        {"index": 2, "label": "negative", "probs": [1.0, 0.0, 0.0], "num_classes": 3}]
    assert body["usage"] == {"prompt_tokens": 6, "total_tokens": 6, "completion_tokens": 0}
    sent = env.workers[0].requests
    assert sorted(r.text for r in sent) == ["a", "a b", "a b c"]  # sent at once: in any order
    assert all(r.task_head and not r.HasField("sampling") and r.adapter.name == CLASSIFIER for r in sent)
    gateway_id = body["id"].removeprefix("classify-")
    assert sorted(r.request_id for r in sent) == [f"{gateway_id}-{i}" for i in range(3)]


def test_rest_detection_of_a_chat_prompt(env: GatewayEnv) -> None:
    response = classify(env, {"model": DETECTOR, "messages": [{"role": "user", "content": "x y"}]})
    assert response.status_code == 200, response.text
    [item] = response.json()["data"]
    assert item["index"] == 0 and set(item) == {"index", "detections"}
    assert [d["label"] for d in item["detections"]] == ["cat", "dog"]
    assert [d["score"] for d in item["detections"]] == pytest.approx([1.0, 0.9])
    assert item["detections"][1]["box"] == pytest.approx([0.1, 0.1, 1.0, 1.0])
    assert env.workers[0].requests[-1].chat.messages[0].content == "x y"


def test_the_answer_fits_the_published_document(env: GatewayEnv) -> None:
    document = requests.get(f"{env.http_base}/openapi.json", timeout=10).json()
    schemas = document["components"]["schemas"]
    for body in ({"model": CLASSIFIER, "input": "a b"}, {"model": DETECTOR, "input": ["a b", "c"]}):
        assert jsonschema.Draft202012Validator(schemas["ClassifyRequest"]).is_valid(body)
        jsonschema.validate(classify(env, body).json(), schemas["Classification"])
    assert "/v1/classify" in document["paths"]


def test_grpc_classify_answers_text_and_chat_inputs_in_order(
        env: GatewayEnv, stub: inference_pb2_grpc.InferenceStub) -> None:
    chat = common_pb2.ChatPrompt(messages=[common_pb2.ChatMessage(role="user", content="p q r s")])
    request = inference_pb2.ClassifyRequest(model=CLASSIFIER, inputs=[*texts("a b"), inference_pb2.ClassifyInput(
        chat=chat)], request_id="my-label")
    request.slo.ttft_ms = 500
    answer = stub.Classify(request, timeout=10)
    assert [r.label for r in answer.results] == ["positive", "neutral"]
    assert [r.label_index for r in answer.results] == [2, 1]
    assert answer.usage.prompt_tokens == 6 and answer.usage.completion_tokens == 0
    sent = env.workers[0].requests
    assert {r.request_id for r in sent} == {f"{answer.request_id}-0", f"{answer.request_id}-1"}
    assert all(r.ttft_slo_ms == 500 for r in sent)


def test_grpc_detection(stub: inference_pb2_grpc.InferenceStub) -> None:
    answer = stub.Classify(inference_pb2.ClassifyRequest(model=DETECTOR, inputs=texts("one")), timeout=10)
    [result] = answer.results
    assert not result.probs and [(d.label, d.label_index) for d in result.detections] == [("cat", 0)]


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"model": ADAPTER, "input": "a"}, "model", f"adapter '{ADAPTER}' has no task head"),
    ({"model": BASE, "input": "a"}, "model", "is a base model"),
    ({"model": CLASSIFIER, "input": "a", "messages": [{"role": "user", "content": "a"}]}, "messages", "exclusive"),
    ({"model": CLASSIFIER}, "input", "is required"),
    ({"model": CLASSIFIER, "input": []}, "input", "non-empty list"),
    ({"model": CLASSIFIER, "input": ["a"] * 65}, "input", "at most 64"),
    ({"model": CLASSIFIER, "input": ["a", ""]}, "input[1]", "non-empty string"),
    ({"model": CLASSIFIER, "input": "a", "user": "me"}, "user", "does not support"),
    ({"model": CLASSIFIER, "input": "a", "max_tokens": 3}, "max_tokens", "unrecognized request argument"),
    ({"model": CLASSIFIER, "input": "a", "tessera_slo": {"tpot_ms": 50}}, "tessera_slo", "unknown fields"),
    ({"model": CLASSIFIER, "messages": [{"role": "robot", "content": "a"}]}, "messages[0].role", "one of"),
])
def test_bad_classify_bodies_are_400_naming_the_field(
        env: GatewayEnv, body: dict[str, Any], param: str, words: str) -> None:
    response = classify(env, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"] and error["type"] == "invalid_request_error"
    assert not env.workers[0].requests


@pytest.mark.parametrize("path", ["chat/completions", "completions"])
def test_a_head_adapter_asked_to_generate_over_rest_is_sent_to_classify(env: GatewayEnv, path: str) -> None:
    prompt = {"messages": [{"role": "user", "content": "a"}]} if path == "chat/completions" else {"prompt": "a"}
    response = requests.post(f"{env.http_base}/v1/{path}", json={"model": CLASSIFIER, **prompt}, timeout=30)
    assert response.status_code == 400
    assert response.json()["error"]["message"] == (
        f"adapter '{CLASSIFIER}' has a task head (kind classifier): ask POST /v1/classify (gRPC Classify)")
    assert not env.workers[0].requests


def test_a_head_adapter_asked_to_generate_over_grpc_is_invalid_argument(
        env: GatewayEnv, stub: inference_pb2_grpc.InferenceStub) -> None:
    request = inference_pb2.GenerateRequest(model=DETECTOR, text="a")
    with pytest.raises(grpc.RpcError) as error:
        list(stub.Generate(request, timeout=10))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "has a task head (kind detection)" in error.value.details()


@pytest.mark.parametrize(("request_", "words"), [
    (inference_pb2.ClassifyRequest(model=BASE, inputs=texts("a")), "is a base model"),
    (inference_pb2.ClassifyRequest(model=ADAPTER, inputs=texts("a")), "has no task head"),
    (inference_pb2.ClassifyRequest(model=CLASSIFIER), "inputs must hold 1 to 64 inputs, got 0"),
    (inference_pb2.ClassifyRequest(model=CLASSIFIER, inputs=texts(*["a"] * 65)), "got 65"),
    (inference_pb2.ClassifyRequest(model=CLASSIFIER, inputs=texts("a", "b", "")), "inputs[2]: prompt must be"),
    (inference_pb2.ClassifyRequest(model=CLASSIFIER, inputs=[inference_pb2.ClassifyInput()]), "a prompt is required"),
    (inference_pb2.ClassifyRequest(model="", inputs=texts("a", "b")), "model is required"),
    (inference_pb2.ClassifyRequest(model=CLASSIFIER, inputs=texts("a"), slo=inference_pb2.Slo(tpot_ms=5)),
     "slo.tpot_ms does not apply"),
])
def test_bad_grpc_classify_requests_are_invalid_argument(
        env: GatewayEnv, stub: inference_pb2_grpc.InferenceStub, request_: inference_pb2.ClassifyRequest,
        words: str) -> None:
    with pytest.raises(grpc.RpcError) as error:
        stub.Classify(request_, timeout=10)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in error.value.details()
    assert not env.workers[0].requests


@pytest.mark.parametrize(("code", "status"), [(grpc.StatusCode.INVALID_ARGUMENT, 400),
                                              (grpc.StatusCode.FAILED_PRECONDITION, 409)])
def test_a_worker_error_fails_the_request_with_its_status(
        env: GatewayEnv, stub: inference_pb2_grpc.InferenceStub, code: grpc.StatusCode, status: int) -> None:
    env.workers[0].reject = (code, "the worker says no")
    response = classify(env, {"model": CLASSIFIER, "input": ["a", "b"]})
    assert response.status_code == status and "the worker says no" in response.json()["error"]["message"]
    with pytest.raises(grpc.RpcError) as error:
        stub.Classify(inference_pb2.ClassifyRequest(model=CLASSIFIER, inputs=texts("a", "b")), timeout=10)
    assert error.value.code() == code and "the worker says no" in error.value.details()


def test_classify_needs_an_api_key_at_both_doors() -> None:
    env = with_head_adapters(GatewayEnv(api_keys=["k"]))
    try:
        body = {"model": CLASSIFIER, "input": "a"}
        assert classify(env, body).status_code == 401
        assert classify(env, body, {"Authorization": "Bearer k"}).status_code == 200
        with grpc.insecure_channel(env.grpc_address) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            request = inference_pb2.ClassifyRequest(model=CLASSIFIER, inputs=texts("a"))
            with pytest.raises(grpc.RpcError) as error:
                stub.Classify(request, timeout=10)
            assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert stub.Classify(request, metadata=(("authorization", "Bearer k"),), timeout=10).results
    finally:
        env.close()
