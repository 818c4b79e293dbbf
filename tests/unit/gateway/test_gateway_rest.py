"""The OpenAI-compatible REST API, end to end through the real gateway to fake workers.

Clients: `requests` for the raw wire format and error statuses, the official `openai`
client for compatibility.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import grpc
import openai
import pytest
import requests

from tests.unit.gateway.gateway_fakes import ADAPTER, BASE, OTHER_BASE, FakeWorker, GatewayEnv

CHAT = {"model": BASE, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 3}


@pytest.fixture
def env() -> Iterator[GatewayEnv]:
    env = GatewayEnv()
    yield env
    env.close()


def client(env: GatewayEnv, api_key: str = "x") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{env.http_base}/v1", api_key=api_key, max_retries=0, timeout=20)


def sse_payloads(response: requests.Response) -> list[str]:
    """The `data:` payloads of an SSE body, checking the framing (`data: ...` then a blank line)."""
    events = response.text.split("\n\n")
    assert events[-1] == "", "every event ends with a blank line"
    assert all(e.startswith("data: ") for e in events[:-1])
    return [e[len("data: "):] for e in events[:-1]]


def test_models_lists_base_models_and_adapters(env: GatewayEnv) -> None:
    body = requests.get(f"{env.http_base}/v1/models").json()
    assert body["object"] == "list"
    by_id = {m["id"]: m for m in body["data"]}
    assert by_id[ADAPTER] == {"id": ADAPTER, "object": "model", "created": 200, "owned_by": "tessera",
                              "root": BASE, "parent": BASE}
    assert by_id[BASE]["parent"] is None and by_id[BASE]["root"] == BASE
    assert {m.id for m in client(env).models.list()} == {BASE, OTHER_BASE, ADAPTER}


def test_chat_with_an_adapter_through_the_openai_client(env: GatewayEnv) -> None:
    reply = client(env).chat.completions.create(model=ADAPTER, messages=[{"role": "user", "content": "a b c"}],
                                                max_tokens=4, temperature=0.5, seed=7)
    assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-")
    assert reply.model == ADAPTER
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == "w0 w1 w2 w3 "
    assert reply.choices[0].finish_reason == "length"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens, reply.usage.total_tokens) == (3, 4, 7)
    sent = env.workers[0].requests[-1]
    assert sent.base_model == BASE and sent.HasField("adapter") and sent.adapter.name == ADAPTER
    assert sent.sampling.max_tokens == 4 and sent.sampling.seed == 7
    assert sent.chat.messages[0].content == "a b c"


def test_base_model_request_sends_no_adapter_and_default_max_tokens(env: GatewayEnv) -> None:
    reply = client(env).completions.create(model=BASE, prompt="one two")
    assert reply.object == "text_completion" and reply.choices[0].text == "w0 w1 w2 w3 w4 "
    sent = env.workers[0].requests[-1]
    assert not sent.HasField("adapter") and sent.text == "one two"
    assert sent.sampling.max_tokens == env.config.gateway.default_max_tokens


def test_stop_token_ids_reach_the_worker(env: GatewayEnv) -> None:
    # vLLM's extension field: the openai client sends it in extra_body.
    client(env).completions.create(model=BASE, prompt="one", max_tokens=2, extra_body={"stop_token_ids": [5, 0]})
    assert list(env.workers[0].requests[-1].sampling.stop_token_ids) == [5, 0]


def test_streams_through_the_openai_client(env: GatewayEnv) -> None:
    chunks = list(client(env).chat.completions.create(model=ADAPTER, messages=[{"role": "user", "content": "hi"}],
                                                      max_tokens=3, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "w0 w1 w2 "
    assert chunks[-1].choices[0].finish_reason == "length"
    assert len({c.id for c in chunks}) == 1
    texts = list(client(env).completions.create(model=BASE, prompt="hi", max_tokens=2, stream=True))
    assert [t.choices[0].text for t in texts] == ["w0 ", "w1 ", ""]
    assert texts[-1].choices[0].finish_reason == "length"


def test_chat_stream_wire_format_with_usage(env: GatewayEnv) -> None:
    response = requests.post(f"{env.http_base}/v1/chat/completions",
                             json={**CHAT, "stream": True, "stream_options": {"include_usage": True}})
    assert response.status_code == 200
    assert response.headers["Content-Type"].startswith("text/event-stream")
    payloads = sse_payloads(response)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [c["choices"][0]["delta"] for c in chunks[1:4]] == [{"content": "w0 "}, {"content": "w1 "}, {"content": "w2 "}]
    assert chunks[4]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
    assert chunks[5]["choices"] == [] and chunks[5]["usage"] == {"prompt_tokens": 2, "completion_tokens": 3,
                                                                 "total_tokens": 5}
    assert all(c["usage"] is None for c in chunks[:5])


@pytest.mark.parametrize(("body", "param", "phrase"), [
    ("{not json", None, "not valid JSON"),
    ("[1, 2]", None, "JSON object"),
    ({"messages": CHAT["messages"]}, "model", "model is required"),
    ({**CHAT, "messages": []}, "messages", "non-empty list"),
    ({**CHAT, "max_tokens": -5}, "max_tokens", "between 1 and 64"),
    ({**CHAT, "max_tokens": 0}, "max_tokens", "between 1 and 64"),
    ({**CHAT, "max_tokens": 10**30}, "max_tokens", "between 1 and 64"),
    ({**CHAT, "max_tokens": "ten"}, "max_tokens", "must be an integer"),
    ({**CHAT, "temperature": 9}, "temperature", "between 0 and 2"),
    ({**CHAT, "stop_token_ids": [3, -1]}, "stop_token_ids[1]", "stop_token_ids[1] must be an integer between 0"),
    ({**CHAT, "stop_token_ids": [False]}, "stop_token_ids[0]", "must be an integer"),
])
def test_validation_errors_are_400_naming_the_param(env: GatewayEnv, body: object, param: str | None,
                                                    phrase: str) -> None:
    data = body if isinstance(body, str) else json.dumps(body)
    response = requests.post(f"{env.http_base}/v1/chat/completions", data=data,
                             headers={"Content-Type": "application/json"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert phrase in error["message"]
    assert env.workers[0].requests == [], "a bad request never reaches a worker"


def test_json_body_with_another_content_type_is_accepted(env: GatewayEnv) -> None:
    response = requests.post(f"{env.http_base}/v1/chat/completions", data=json.dumps(CHAT),
                             headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert response.status_code == 200 and response.json()["choices"][0]["message"]["content"] == "w0 w1 w2 "


def test_unknown_model_is_404(env: GatewayEnv) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client(env).chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    assert "model 'nope' does not exist; the available models are listed by GET /v1/models (REST) and ListModels (gRPC)" in str(info.value)
    assert info.value.body["param"] == "model"


def test_worker_invalid_argument_stays_400(env: GatewayEnv) -> None:
    env.workers[0].reject = (grpc.StatusCode.INVALID_ARGUMENT, "prompt is 9000 tokens; the context holds 2048")
    response = requests.post(f"{env.http_base}/v1/chat/completions", json=CHAT)
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "prompt is 9000 tokens; the context holds 2048"


def test_worker_overload_is_429_with_retry_after(env: GatewayEnv) -> None:
    env.workers[0].reject = (grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")
    response = requests.post(f"{env.http_base}/v1/chat/completions", json=CHAT)
    assert response.status_code == 429 and int(response.headers["Retry-After"]) >= 1
    assert response.json()["error"]["type"] == "overloaded_error"


def test_a_model_without_a_live_worker_is_503_saying_how_to_start_one(env: GatewayEnv) -> None:
    response = requests.post(f"{env.http_base}/v1/chat/completions", json={**CHAT, "model": OTHER_BASE})
    assert response.status_code == 503 and "Retry-After" in response.headers
    message = response.json()["error"]["message"]
    assert "no live worker serves base model 'tiny-qwen': start one" in message
    assert "tessera serve worker" in message and "TESSERA_WORKER__BASE_MODEL=tiny-qwen" in message


def test_mid_stream_worker_failure_ends_the_stream_with_an_error_event(env: GatewayEnv) -> None:
    env.workers[0].fail_after = 2
    response = requests.post(f"{env.http_base}/v1/chat/completions", json={**CHAT, "max_tokens": 5, "stream": True})
    payloads = sse_payloads(response)
    assert "[DONE]" not in payloads
    error = json.loads(payloads[-1])["error"]
    assert error["type"] == "service_unavailable_error" and "worker0 crashed" in error["message"]


def test_mid_stream_worker_failure_raises_in_the_openai_client(env: GatewayEnv) -> None:
    env.workers[0].fail_after = 2
    with pytest.raises(openai.APIError, match="worker0 crashed"):
        for _ in client(env).chat.completions.create(model=BASE, messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=5, stream=True):
            pass


def test_a_worker_failing_before_any_token_is_skipped() -> None:
    # Round-robin is sure to try both workers; tessera would batch every request onto one of them.
    env = GatewayEnv(workers=2, policy="round-robin")
    try:
        env.workers[0].fail_after = 0
        for _ in range(4):
            assert requests.post(f"{env.http_base}/v1/chat/completions", json=CHAT).status_code == 200
        # worker0 failed once, then sat out its mark-down time; worker1 served every request.
        assert len(env.workers[0].requests) == 1 and len(env.workers[1].requests) == 4
    finally:
        env.close()


def test_registry_down_after_the_first_refresh_still_serves(env: GatewayEnv) -> None:
    env.stop_registry()
    assert not env.refresh()
    reply = client(env).chat.completions.create(model=ADAPTER, messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=2)
    assert reply.choices[0].message.content == "w0 w1 "
    assert ADAPTER in {m.id for m in client(env).models.list()}


def test_client_disconnect_cancels_the_worker_call(env: GatewayEnv) -> None:
    worker: FakeWorker = env.workers[0]
    worker.delay_s = 0.1
    with requests.post(f"{env.http_base}/v1/chat/completions", json={**CHAT, "max_tokens": 60, "stream": True},
                       stream=True) as response:
        lines = response.iter_lines()
        assert next(lines).startswith(b"data: ")
    deadline = time.monotonic() + 5
    while worker.cancelled == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert worker.cancelled == 1, "the worker kept generating for a client that left"


def test_api_keys_are_enforced_when_configured() -> None:
    env = GatewayEnv(api_keys=["k-secret", "k-other"])
    try:
        url = f"{env.http_base}/v1/models"
        assert requests.get(url).status_code == 401
        assert requests.get(url, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert requests.get(url, headers={"Authorization": "Bearer k-other"}).status_code == 200
        assert requests.get(f"{env.http_base}/healthz").status_code == 200
        with pytest.raises(openai.AuthenticationError):
            client(env, "nope").chat.completions.create(model=BASE, messages=CHAT["messages"])
        assert client(env, "k-secret").chat.completions.create(model=BASE, messages=CHAT["messages"]).choices
    finally:
        env.close()


def test_health_and_unknown_routes(env: GatewayEnv) -> None:
    assert requests.get(f"{env.http_base}/healthz").json() == {"status": "ok"}
    response = requests.get(f"{env.http_base}/v1/nothing")
    assert response.status_code == 404 and "error" in response.json()
    assert requests.get(f"{env.http_base}/v1/chat/completions").status_code == 405


def test_the_rest_id_is_the_gateways_request_id_that_the_worker_sees(env: GatewayEnv) -> None:
    chat = requests.post(f"{env.http_base}/v1/chat/completions", json=CHAT, timeout=20).json()
    assert chat["id"] == "chatcmpl-" + env.workers[0].requests[-1].request_id

    streamed = requests.post(f"{env.http_base}/v1/completions", timeout=20,
                             json={"model": BASE, "prompt": "one", "max_tokens": 2, "stream": True})
    chunks = [json.loads(p) for p in sse_payloads(streamed)[:-1]]  # the last payload is [DONE]
    gateway_id = env.workers[0].requests[-1].request_id
    assert gateway_id and {c["id"] for c in chunks} == {"cmpl-" + gateway_id}
