"""Admission control and per-request SLOs through the real gateway to fake workers: overload is a
fast 429 / RESOURCE_EXHAUSTED with a retry-after hint; malformed SLOs are clear 400s."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Iterator

import grpc
import pytest
import requests

from tests.unit.gateway.gateway_fakes import BASE, GatewayEnv
from tessera.v1 import common_pb2, inference_pb2, inference_pb2_grpc

CHAT = {"model": BASE, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 3}


@pytest.fixture
def env() -> Iterator[GatewayEnv]:
    env = GatewayEnv(max_queued=2)
    env.workers[0].delay_s = 0.05  # 20 tokens: each request holds its place for ~1 s
    yield env
    env.close()


def test_beyond_the_bound_rest_is_429_and_grpc_resource_exhausted(env: GatewayEnv) -> None:
    started = threading.Barrier(3)

    def slow_request() -> requests.Response:
        started.wait()
        return requests.post(f"{env.http_base}/v1/chat/completions", json={**CHAT, "max_tokens": 20}, timeout=30)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        accepted = [pool.submit(slow_request) for _ in range(2)]
        started.wait()
        while len(env.workers[0].running) < 2:  # both places are taken once the worker runs both
            threading.Event().wait(0.01)
        rejected = requests.post(f"{env.http_base}/v1/chat/completions", json=CHAT, timeout=30)
        with grpc.insecure_channel(env.grpc_address) as channel:
            with pytest.raises(grpc.RpcError) as info:
                list(inference_pb2_grpc.InferenceStub(channel).Generate(inference_pb2.GenerateRequest(
                    model=BASE, text="hi", sampling=common_pb2.SamplingParams(max_tokens=3))))
        results = [f.result() for f in accepted]

    assert rejected.status_code == 429 and int(rejected.headers["Retry-After"]) >= 1
    assert rejected.json()["error"]["type"] == "overloaded_error"
    assert f"base model '{BASE}' is overloaded: 2 requests in flight" in rejected.json()["error"]["message"]
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert float(dict(info.value.trailing_metadata())["retry-after"]) > 0
    for result in results:  # nothing lost from the accepted ones
        assert result.status_code == 200 and result.json()["usage"]["completion_tokens"] == 20
    assert requests.post(f"{env.http_base}/v1/chat/completions", json=CHAT, timeout=30).status_code == 200


@pytest.mark.parametrize("slo, param, message", [
    ([50], "tessera_slo", "tessera_slo must be an object"),
    ({"tpot": 50}, "tessera_slo", "unknown fields ['tpot']"),
    ({"tpot_ms": "fast"}, "tessera_slo.tpot_ms", "must be a number"),
    ({"ttft_ms": 0}, "tessera_slo.ttft_ms", "must be a number of milliseconds in (0, 3600000]"),
    ({"tpot_ms": -5}, "tessera_slo.tpot_ms", "got -5.0"),
])
def test_malformed_rest_slo_is_400(env: GatewayEnv, slo: object, param: str, message: str) -> None:
    response = requests.post(f"{env.http_base}/v1/chat/completions", json={**CHAT, "tessera_slo": slo}, timeout=30)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"]


def test_slo_accepted_on_both_doors(env: GatewayEnv) -> None:
    response = requests.post(f"{env.http_base}/v1/chat/completions",
                             json={**CHAT, "tessera_slo": {"tpot_ms": 50, "ttft_ms": 2000}}, timeout=30)
    assert response.status_code == 200
    with grpc.insecure_channel(env.grpc_address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        request = inference_pb2.GenerateRequest(model=BASE, text="hi", sampling=common_pb2.SamplingParams(max_tokens=2),
                                                slo=inference_pb2.Slo(tpot_ms=50))
        assert list(stub.Generate(request))[-1].WhichOneof("payload") == "final"
        request.slo.ttft_ms = -1
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(request))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "slo.ttft_ms must be" in info.value.details()
