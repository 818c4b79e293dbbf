"""The whole system on loopback: every front door gives transformers + PEFT's greedy tokens.

Requests for the base model and each demo adapter go through the gateway (REST,
streamed and not; gRPC) to the worker; outputs must equal `PeftModel.generate`
token for token, also when all four are in flight together and share batches.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import grpc
import openai
import pytest
import requests

from tessera.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from tests.reference import ReferenceModels, assert_same_greedy

pytestmark = pytest.mark.integration

BASE = "tessera-demo-llama"
MODELS = [BASE, "demo-r8", "demo-r16", "demo-r64"]
MAX_TOKENS = 12
PROMPTS = {
    BASE: "Tell me about serving many adapters.",
    "demo-r8": "What is a low-rank adapter?",
    "demo-r16": "Write one line about GPUs and memory bandwidth, please.",
    "demo-r64": "Hi",
}


@pytest.fixture(scope="module")
def reference(system) -> ReferenceModels:
    """PEFT loads exactly the files the registry stored (its content-addressed copies)."""
    auth = {"Authorization": f"Bearer {system.admin_key}"}
    base = requests.get(f"{system.admin_base}/base-models", headers=auth, timeout=10).json()
    adapters = requests.get(f"{system.admin_base}/adapters", headers=auth, timeout=10).json()
    base_path = next(b["path"] for b in _items(base) if b["name"] == BASE)
    return ReferenceModels(BASE, base_path, {a["name"]: a["storage_path"] for a in _items(adapters)})


def _items(listing):
    """Admin list endpoints answer a JSON list or an object wrapping one."""
    return listing if isinstance(listing, list) else next(v for v in listing.values() if isinstance(v, list))


@pytest.fixture(scope="module")
def client(system) -> openai.OpenAI:
    return openai.OpenAI(base_url=system.http_base, api_key="unused", max_retries=0, timeout=120)


def chat_messages(model: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": "You are terse."}, {"role": "user", "content": PROMPTS[model]}]


def rest_chat(client: openai.OpenAI, model: str) -> tuple[str, int]:
    reply = client.chat.completions.create(model=model, messages=chat_messages(model),
                                           max_tokens=MAX_TOKENS, temperature=0)
    return reply.choices[0].message.content, reply.usage.completion_tokens


def rest_chat_stream(client: openai.OpenAI, model: str) -> tuple[str, int]:
    stream = client.chat.completions.create(model=model, messages=chat_messages(model), max_tokens=MAX_TOKENS,
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    text, usage = "", None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
    return text, usage


def grpc_chat(address: str, model: str) -> list[int]:
    request = inference_pb2.GenerateRequest(
        model=model,
        chat=common_pb2.ChatPrompt(messages=[common_pb2.ChatMessage(**m) for m in chat_messages(model)]),
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    tokens: list[int] = []
    with grpc.insecure_channel(address) as channel:
        final = None
        for reply in inference_pb2_grpc.InferenceStub(channel).Generate(request, timeout=120):
            if reply.HasField("delta"):
                tokens.extend(reply.delta.token_ids)
            else:
                final = reply.final
    assert final is not None and final.usage.completion_tokens == len(tokens)
    return tokens


@pytest.mark.parametrize("model", MODELS)
def test_rest_and_grpc_equal_peft_greedy(system, client, reference, model):
    expected = reference.greedy_chat(model, chat_messages(model), MAX_TOKENS)
    assert_same_greedy(model, expected, grpc_chat(system.gateway_grpc, model))
    for call in (rest_chat, rest_chat_stream):
        text, completion_tokens = call(client, model)
        assert text == reference.decode(expected.tokens), call.__name__
        assert completion_tokens == len(expected.tokens)


def test_completions_endpoint_equals_peft_greedy(system, client, reference):
    prompt = "The quick brown fox"
    expected = reference.greedy_text("demo-r16", prompt, MAX_TOKENS)
    reply = client.completions.create(model="demo-r16", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    assert reply.choices[0].text == reference.decode(expected.tokens)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="demo-r16", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True) if c.choices)
    assert streamed == reply.choices[0].text


def test_chat_logprobs_equal_peft(client, reference):
    """logprobs=true, top_logprobs=2: every token's log-probability, and the two likeliest, are PEFT's."""
    model = "demo-r16"
    expected = reference.greedy_chat(model, chat_messages(model), MAX_TOKENS)
    ask = dict(model=model, messages=chat_messages(model), max_tokens=MAX_TOKENS, temperature=0,
               logprobs=True, top_logprobs=2)
    reply = client.chat.completions.create(**ask)
    assert reply.choices[0].message.content == reference.decode(expected.tokens)
    content = reply.choices[0].logprobs.content
    assert len(content) == len(expected.tokens)
    texts = reference.tokenizer.batch_decode([[t] for t in expected.tokens], skip_special_tokens=False)
    for step, (entry, token, text, logprobs) in enumerate(zip(content, expected.tokens, texts, expected.logprobs)):
        assert entry.token == text, step
        assert abs(entry.logprob - float(logprobs[token])) < 1e-4, step
        top = entry.top_logprobs
        assert len(top) == 2 and top[0].logprob >= top[1].logprob, step
        assert (top[0].token, top[0].logprob) == (entry.token, entry.logprob), "the greedy token is the likeliest"
        assert all(abs(t.logprob - float(r)) < 1e-4 for t, r in zip(top, logprobs.topk(2).values)), step
    streamed = [e for chunk in client.chat.completions.create(**ask, stream=True)
                if chunk.choices and chunk.choices[0].logprobs for e in chunk.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    # Each request's steps may run merged or unmerged (the mode policy decides by the time steps take):
    # both equal PEFT's within the bound above, not always each other's within less.
    assert all(abs(s.logprob - e.logprob) < 1e-4 for s, e in zip(streamed, content))


def mixed_steps(system) -> float:
    """Engine steps so far whose forward pass held more than one model (worker's /metrics)."""
    series = {}
    for line in requests.get(system.worker_metrics, timeout=10).text.splitlines():
        if line.startswith("tessera_worker_step_models_"):
            name, value = line.rsplit(" ", 1)
            series[name] = float(value)
    return series["tessera_worker_step_models_count"] - series['tessera_worker_step_models_bucket{le="1.0"}']


def test_concurrent_requests_for_all_models_share_batches(system, client, reference):
    """All four models in flight at once, over REST and gRPC, share forward passes and still give PEFT's tokens."""
    expected = {m: reference.greedy_chat(m, chat_messages(m), MAX_TOKENS) for m in MODELS}
    mixed_before = mixed_steps(system)
    results: dict[tuple[str, str], object] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(MODELS) * 2)

    def run(kind: str, model: str, call: Callable[[], object]) -> None:
        try:
            barrier.wait(timeout=30)
            results[(kind, model)] = call()
        except BaseException as exc:  # surfaced below with the model's name
            errors.append(exc)

    threads = []
    for model in MODELS:
        threads.append(threading.Thread(target=run, args=("grpc", model, lambda m=model: grpc_chat(system.gateway_grpc, m))))
        threads.append(threading.Thread(target=run, args=("rest", model, lambda m=model: rest_chat_stream(client, m))))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    assert not errors, errors
    assert mixed_steps(system) > mixed_before, "no engine step mixed adapters"
    for model in MODELS:
        assert_same_greedy(model, expected[model], results[("grpc", model)])
        text, _ = results[("rest", model)]
        assert text == reference.decode(expected[model].tokens)


def test_models_endpoint_lists_base_and_adapters(client):
    ids = {m.id for m in client.models.list().data}
    assert set(MODELS) <= ids
