"""stop_token_ids through the real processes: a REST request ends right after the stop token."""

from __future__ import annotations

import grpc
import pytest
import requests

from tessera.v1 import common_pb2, inference_pb2, inference_pb2_grpc

pytestmark = pytest.mark.integration

MODEL = "demo-r8"
PROMPT = "The quick brown fox"
MAX_TOKENS = 12


def grpc_greedy_tokens(address: str) -> list[int]:
    """The greedy token ids (REST answers with text only)."""
    request = inference_pb2.GenerateRequest(model=MODEL, text=PROMPT,
                                            sampling=common_pb2.SamplingParams(max_tokens=MAX_TOKENS))
    with grpc.insecure_channel(address) as channel:
        replies = list(inference_pb2_grpc.InferenceStub(channel).Generate(request, timeout=120))
    assert replies[-1].final.finish_reason == common_pb2.FINISH_REASON_LENGTH
    return [t for r in replies if r.HasField("delta") for t in r.delta.token_ids]


def rest_completion(system, **fields) -> requests.Response:
    return requests.post(f"{system.http_base}/completions", timeout=120, json={
        "model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, **fields})


def test_rest_stop_token_ids_stop_early(system):
    tokens = grpc_greedy_tokens(system.gateway_grpc)
    assert len(tokens) == MAX_TOKENS
    end = tokens.index(tokens[3]) + 1  # right after the stop token's first occurrence, itself included
    free, stopped = rest_completion(system), rest_completion(system, stop_token_ids=[tokens[3]])
    assert free.status_code == stopped.status_code == 200, (free.text, stopped.text)
    free, stopped = free.json(), stopped.json()
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["usage"]["completion_tokens"] == end < MAX_TOKENS
    assert free["choices"][0]["text"].startswith(stopped["choices"][0]["text"])


def test_rest_stop_token_id_outside_the_vocabulary_is_400(system):
    """The gateway knows no vocabulary; the worker refuses the id and the gateway answers 400."""
    reply = rest_completion(system, stop_token_ids=[10**6])
    assert reply.status_code == 400, reply.text
    assert "outside this model's vocabulary" in reply.json()["error"]["message"]
