"""Inputs that used to be server errors, through the real gateway: each is now a 400 or
INVALID_ARGUMENT naming what is wrong, nothing is logged as an error, and the gateway goes on
serving. (REST: a 100,000-deep JSON body was a RecursionError, a lone surrogate and top_k = 2**70
failed on their way into the proto; gRPC: a string field that is not UTF-8 ended UNKNOWN with a
logged traceback.)"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import grpc
import pytest
import requests

from tests.unit.gateway.gateway_fakes import BASE, GatewayEnv
from tessera.v1 import common_pb2, inference_pb2, inference_pb2_grpc

CHAT = {"model": BASE, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
HUGE = 2**70


@pytest.fixture(scope="module")
def env() -> Iterator[GatewayEnv]:
    env = GatewayEnv()
    yield env
    env.close()


@pytest.fixture
def no_errors_logged(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    caplog.set_level(logging.WARNING)
    yield
    assert [(r.name, r.getMessage()) for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info] == []


def post(env: GatewayEnv, path: str, data: bytes | str) -> requests.Response:
    return requests.post(f"{env.http_base}/v1/{path}", data=data, headers={"Content-Type": "application/json"},
                         timeout=30)


def chat(**fields: object) -> str:
    return json.dumps({**CHAT, **fields})


def assert_still_serving(env: GatewayEnv) -> None:
    response = requests.post(f"{env.http_base}/v1/chat/completions", json=CHAT, timeout=30)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(("path", "body", "param", "phrase"), [
    ("chat/completions", "[" * 100_000 + "]" * 100_000, None, "nests objects or arrays deeper than"),
    ("chat/completions", '{"model": "m", "messages": ' + "[" * 5_000 + "]" * 5_000 + "}", None, "deeper than"),
    ("chat/completions", chat(messages=[{"role": "user", "content": "a\ud800b"}]), "messages[0].content",
     "lone surrogate"),
    ("chat/completions", chat(stop=["\udfff"]), "stop[0]", "lone surrogate"),
    ("completions", json.dumps({"model": "m\udc80", "prompt": "hi"}), "model", "lone surrogate"),
    ("chat/completions", chat(top_k=HUGE), "top_k", "top_k must be an integer between 0 and 2147483647"),
    ("chat/completions", chat(max_tokens=HUGE), "max_tokens", "between 1 and 64"),
    ("chat/completions", chat(max_completion_tokens=HUGE), "max_completion_tokens", "between 1 and 64"),
    ("chat/completions", chat(seed=2**64), "seed", "between 0 and 18446744073709551615"),
    ("chat/completions", chat(n=HUGE), "n", "n must be 1"),
    ("chat/completions", chat(logprobs=True, top_logprobs=HUGE), "top_logprobs", "between 0 and 20"),
    ("completions", json.dumps({"model": BASE, "prompt": "hi", "logprobs": HUGE}), "logprobs", "between 0 and 5"),
    ("chat/completions", chat(stop_token_ids=[HUGE]), "stop_token_ids[0]", "between 0 and 2147483647"),
    ("chat/completions", chat(stop=["a", "b", "c", "d", "e"]), "stop", "at most 4 items"),
    ("chat/completions", chat(tessera_slo={"ttft_ms": 5e-324}), "tessera_slo.ttft_ms", "between 1 and 3600000"),
    ("chat/completions", '{"model": "m", "temperature": NaN, "messages": []}', None, "NaN is not allowed"),
    ("chat/completions", '{"model": "m", "temperature": 1e999, "messages": []}', None, "overflows"),
    ("chat/completions", b'{"model": "\xff\xfe", "messages": []}', None, "not valid JSON"),
    ("chat/completions", '{"model": "m", "max_tokens": 1' + "0" * 5000 + "}", None, "not valid JSON"),
    ("chat/completions", chat(model="m" * 300), "model", "model is too long: 300 characters, the limit is 256"),
])
def test_bad_rest_inputs_are_400_and_nothing_else_is_disturbed(
        env: GatewayEnv, no_errors_logged: None, path: str, body: str | bytes, param: str | None, phrase: str) -> None:
    sent_before = len(env.workers[0].requests)
    response = post(env, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert phrase in error["message"]
    assert len(error["message"]) < 400, "a bad value is quoted back shortened"
    assert len(env.workers[0].requests) == sent_before, "a bad request never reaches a worker"
    assert_still_serving(env)


# gRPC: the same inputs on the wire. A string field holding bytes that are not UTF-8 is built by
# serializing a placeholder of the same length and swapping the bytes in, so every length prefix
# stays right: the message is well formed except for that string.

PLACEHOLDER = "@@"


def with_invalid_utf8(request: inference_pb2.GenerateRequest) -> bytes:
    data = request.SerializeToString()
    assert data.count(PLACEHOLDER.encode()) == 1
    return data.replace(PLACEHOLDER.encode(), b"\xff\xfe")


def chat_request(content: str = "hello", model: str = BASE, **sampling: object) -> inference_pb2.GenerateRequest:
    return inference_pb2.GenerateRequest(
        model=model, chat=common_pb2.ChatPrompt(messages=[common_pb2.ChatMessage(role="user", content=content)]),
        sampling=common_pb2.SamplingParams(max_tokens=2, **sampling))


@pytest.fixture(scope="module")
def channel(env: GatewayEnv) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(env.grpc_address) as channel:
        yield channel


def generate_raw(channel: grpc.Channel, data: bytes) -> list[bytes]:
    return list(channel.unary_stream("/tessera.v1.Inference/Generate")(data, timeout=20))


@pytest.mark.parametrize("request_", [
    chat_request(model=PLACEHOLDER),
    chat_request(content=PLACEHOLDER),
    inference_pb2.GenerateRequest(model=BASE, text=PLACEHOLDER),
    inference_pb2.GenerateRequest(model=BASE, text="hi", request_id=PLACEHOLDER),
    chat_request(stop=[PLACEHOLDER]),
], ids=["model", "chat-content", "text", "request-id", "stop"])
def test_grpc_string_fields_that_are_not_utf8_are_invalid_argument(
        env: GatewayEnv, channel: grpc.Channel, no_errors_logged: None,
        request_: inference_pb2.GenerateRequest) -> None:
    sent_before = len(env.workers[0].requests)
    with pytest.raises(grpc.RpcError) as info:
        generate_raw(channel, with_invalid_utf8(request_))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "does not parse" in info.value.details() and "UTF-8" in info.value.details()
    assert len(env.workers[0].requests) == sent_before
    assert_still_serving(env)


def test_grpc_garbage_and_truncated_messages_are_invalid_argument(
        env: GatewayEnv, channel: grpc.Channel, no_errors_logged: None) -> None:
    whole = chat_request().SerializeToString()
    for data in (whole[:-3], b"\xff" * 8, whole + b"\x0a\x7f"):
        with pytest.raises(grpc.RpcError) as info:
            generate_raw(channel, data)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, data
    assert_still_serving(env)


@pytest.mark.parametrize(("request_", "phrase"), [
    (inference_pb2.GenerateRequest(model=BASE, text="hi", slo=inference_pb2.Slo(ttft_ms=5e-324)),
     "slo.ttft_ms must be a number between 1 and 3600000"),
    (inference_pb2.GenerateRequest(model=BASE, text="hi", slo=inference_pb2.Slo(tpot_ms=float("nan"))),
     "slo.tpot_ms must be"),
    (chat_request(temperature=float("inf")), "temperature must be between 0 and 2"),
    (chat_request(top_p=float("nan")), "top_p must be in (0, 1]"),
    (chat_request(top_k=-2**31), "top_k must be an integer between 0 and 2147483647"),
    (chat_request(model="m" * 300), "model is too long"),
])
def test_grpc_out_of_range_values_are_invalid_argument(
        env: GatewayEnv, channel: grpc.Channel, no_errors_logged: None,
        request_: inference_pb2.GenerateRequest, phrase: str) -> None:
    with pytest.raises(grpc.RpcError) as info:
        list(inference_pb2_grpc.InferenceStub(channel).Generate(request_, timeout=20))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert phrase in info.value.details()
    assert_still_serving(env)
