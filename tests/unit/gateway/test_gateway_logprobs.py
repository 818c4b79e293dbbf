"""Log-probabilities through the real gateway to fake workers: OpenAI's objects over REST
(chat and completions, streamed and not) and the TokenLogprob messages over gRPC."""

from __future__ import annotations

import json
from collections.abc import Iterator

import grpc
import openai
import pytest
import requests

from gateway.openai_api import CHAT as CHAT_SHAPE, TEXT as TEXT_SHAPE, Reply
from gateway.schemas import parse_completion_request
from services.common.config import GatewayConfig
from tests.unit.gateway.gateway_fakes import BASE, GatewayEnv, fake_logprobs
from tessera.v1 import common_pb2, inference_pb2, inference_pb2_grpc

MESSAGES = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def env() -> Iterator[GatewayEnv]:
    env = GatewayEnv()
    yield env
    env.close()


def client(env: GatewayEnv) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{env.http_base}/v1", api_key="x", max_retries=0, timeout=20)


def sse_chunks(response: requests.Response) -> list[dict]:
    payloads = [e[len("data: "):] for e in response.text.split("\n\n") if e]
    assert payloads[-1] == "[DONE]"
    return [json.loads(p) for p in payloads[:-1]]


def test_chat_logprobs_through_the_openai_client(env: GatewayEnv) -> None:
    reply = client(env).chat.completions.create(model=BASE, messages=MESSAGES, max_tokens=3,
                                                logprobs=True, top_logprobs=2)
    content = reply.choices[0].logprobs.content
    assert [c.token for c in content] == ["w0 ", "w1 ", "w2 "]
    assert all(c.logprob == -0.25 for c in content)
    assert content[1].bytes == list(b"w1 ")
    assert [(t.token, t.logprob, t.bytes) for t in content[1].top_logprobs] == [
        ("w1 ", -0.25, list(b"w1 ")), ("w2 ", -1.25, list(b"w2 "))]
    sent = env.workers[0].requests[-1].sampling
    assert sent.HasField("logprobs") and sent.logprobs == 2


def test_chat_logprobs_true_alone_asks_for_no_alternatives(env: GatewayEnv) -> None:
    reply = client(env).chat.completions.create(model=BASE, messages=MESSAGES, max_tokens=2, logprobs=True)
    assert [c.top_logprobs for c in reply.choices[0].logprobs.content] == [[], []]
    assert env.workers[0].requests[-1].sampling.logprobs == 0


def test_no_logprobs_unless_asked(env: GatewayEnv) -> None:
    body = requests.post(f"{env.http_base}/v1/chat/completions",
                         json={"model": BASE, "messages": MESSAGES, "max_tokens": 2}).json()
    assert body["choices"][0]["logprobs"] is None
    assert not env.workers[0].requests[-1].sampling.HasField("logprobs")
    body = requests.post(f"{env.http_base}/v1/completions", json={"model": BASE, "prompt": "p", "max_tokens": 2}).json()
    assert body["choices"][0]["logprobs"] is None


def test_chat_stream_carries_each_tokens_logprobs(env: GatewayEnv) -> None:
    response = requests.post(f"{env.http_base}/v1/chat/completions", json={
        "model": BASE, "messages": MESSAGES, "max_tokens": 2, "logprobs": True, "top_logprobs": 1, "stream": True})
    chunks = sse_chunks(response)
    choices = [c["choices"][0] for c in chunks]
    assert choices[0]["logprobs"] is None and choices[-1]["logprobs"] is None  # the role chunk, the finish chunk
    assert [c["logprobs"] for c in choices[1:-1]] == [
        {"content": [{"token": f"w{i} ", "logprob": -0.25, "bytes": list(f"w{i} ".encode()),
                      "top_logprobs": [{"token": f"w{i} ", "logprob": -0.25, "bytes": list(f"w{i} ".encode())}]}]}
        for i in range(2)]


def test_completion_logprobs_through_the_openai_client(env: GatewayEnv) -> None:
    reply = client(env).completions.create(model=BASE, prompt="p", max_tokens=3, logprobs=2)
    logprobs = reply.choices[0].logprobs
    assert logprobs.tokens == ["w0 ", "w1 ", "w2 "]
    assert logprobs.token_logprobs == [-0.25] * 3
    assert logprobs.top_logprobs == [{f"w{i} ": -0.25, f"w{i + 1} ": -1.25} for i in range(3)]
    assert logprobs.text_offset == [0, 3, 6]
    assert "".join(reply.choices[0].text[o:o + 3] for o in logprobs.text_offset) == reply.choices[0].text


def test_completion_stream_offsets_run_across_chunks(env: GatewayEnv) -> None:
    chunks = list(client(env).completions.create(model=BASE, prompt="p", max_tokens=3, logprobs=0, stream=True))
    with_logprobs = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs is not None]
    assert [(lp.tokens, lp.text_offset, lp.top_logprobs) for lp in with_logprobs] == [
        ([f"w{i} "], [3 * i], [{}]) for i in range(3)]


@pytest.mark.parametrize(("path", "fields", "param"), [
    ("chat/completions", {"top_logprobs": 3}, "top_logprobs"),
    ("chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("completions", {"logprobs": 6}, "logprobs"),
])
def test_out_of_range_logprobs_are_400(env: GatewayEnv, path: str, fields: dict, param: str) -> None:
    before = len(env.workers[0].requests)
    prompt = {"messages": MESSAGES} if path.startswith("chat") else {"prompt": "p"}
    response = requests.post(f"{env.http_base}/v1/{path}", json={"model": BASE, **prompt, **fields})
    assert response.status_code == 400 and response.json()["error"]["param"] == param
    assert len(env.workers[0].requests) == before


def test_grpc_passes_logprobs_through(env: GatewayEnv) -> None:
    request = inference_pb2.GenerateRequest(
        model=BASE, text="p", sampling=common_pb2.SamplingParams(max_tokens=2, logprobs=3))
    with grpc.insecure_channel(env.grpc_address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        deltas = [r.delta for r in stub.Generate(request, timeout=10) if r.HasField("delta")]
        assert [list(d.logprobs) for d in deltas] == [[fake_logprobs(0, 3)], [fake_logprobs(1, 3)]]
        request.sampling.logprobs = 21
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(request, timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "logprobs" in info.value.details()


def test_text_offsets_follow_the_deltas_text_including_empty_deltas() -> None:
    """A token that ends inside a UTF-8 character streams no text: the next token starts at the same offset."""
    api = parse_completion_request({"model": "m", "prompt": "p", "logprobs": 1}, GatewayConfig())
    deltas = [common_pb2.TokenDelta(token_ids=[i], text=text, logprobs=[fake_logprobs(i, 1)])
              for i, text in enumerate(["ab", "", "\u00e9c"])]
    assert Reply(TEXT_SHAPE, api, 0).logprobs(deltas)["text_offset"] == [0, 2, 2]
    assert Reply(TEXT_SHAPE, api, 0).logprobs(deltas[2:], start=2)["text_offset"] == [2]
    assert [c["token"] for c in Reply(CHAT_SHAPE, api, 0).logprobs(deltas)["content"]] == ["w0 ", "w1 ", "w2 "]
