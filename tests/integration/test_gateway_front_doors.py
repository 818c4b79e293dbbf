"""The gateway's two front doors against inputs that used to be server errors, on the real system
(a real worker behind them): each is a 400 / INVALID_ARGUMENT, what is merely unusual (a NUL in
the text) is served, and the system goes on serving."""

from __future__ import annotations

import json

import grpc
import pytest
import requests

from tessera.v1 import common_pb2, inference_pb2, inference_pb2_grpc

pytestmark = pytest.mark.integration

BASE = "tessera-demo-llama"
CHAT = {"model": BASE, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}


def post_raw(system, body: str) -> requests.Response:
    return requests.post(f"{system.http_base}/chat/completions", data=body.encode("utf-8", "surrogatepass"),
                         headers={"Content-Type": "application/json"}, timeout=60)


@pytest.mark.parametrize(("body", "phrase"), [
    ("[" * 100_000 + "]" * 100_000, "nests objects or arrays deeper than"),
    (json.dumps({**CHAT, "messages": [{"role": "user", "content": "a\ud800"}]}), "lone surrogate"),
    (json.dumps({**CHAT, "top_k": 2**70}), "top_k must be an integer between 0 and 2147483647"),
])
def test_rest_bad_inputs_are_400_and_the_system_keeps_serving(system, body: str, phrase: str) -> None:
    response = post_raw(system, body)
    assert response.status_code == 400, response.text
    assert phrase in response.json()["error"]["message"]
    assert post_raw(system, json.dumps(CHAT)).status_code == 200


def test_a_nul_character_in_the_text_is_served_by_both_doors(system) -> None:
    response = post_raw(system, json.dumps({**CHAT, "messages": [{"role": "user", "content": "a\u0000b"}],
                                            "stop": ["\u0000"]}))
    assert response.status_code == 200, response.text
    with grpc.insecure_channel(system.gateway_grpc) as channel:
        replies = list(inference_pb2_grpc.InferenceStub(channel).Generate(inference_pb2.GenerateRequest(
            model=BASE, text="a\x00b", sampling=common_pb2.SamplingParams(max_tokens=2)), timeout=60))
    assert replies[-1].WhichOneof("payload") == "final"


def test_grpc_string_that_is_not_utf8_is_invalid_argument(system) -> None:
    data = inference_pb2.GenerateRequest(model="@@", text="hi").SerializeToString().replace(b"@@", b"\xff\xfe")
    with grpc.insecure_channel(system.gateway_grpc) as channel:
        with pytest.raises(grpc.RpcError) as info:
            list(channel.unary_stream("/tessera.v1.Inference/Generate")(data, timeout=60))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "UTF-8" in info.value.details()
    assert post_raw(system, json.dumps(CHAT)).status_code == 200


def test_openapi_document_is_served(system) -> None:
    root = system.http_base.removesuffix("/v1")
    document = requests.get(f"{root}/openapi.json", timeout=10).json()
    assert document["openapi"] == "3.1.0" and "/v1/chat/completions" in document["paths"]
