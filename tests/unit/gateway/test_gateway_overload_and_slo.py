"""Admission control and per-request SLOs through the real gateway to fake workers: overload is a
fast 429 / RESOURCE_EXHAUSTED with a retry-after hint; malformed SLOs are clear 400s; a request's
objectives default to its adapter's (the registry's), then to the gateway's."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Iterator

import grpc
import pytest
import requests

from gateway.core import routing_request
from gateway.registry_cache import ResolvedModel
from services.common.config import GatewayConfig
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
    trailers = dict(info.value.trailing_metadata())
    assert int(trailers["retry-after"]) >= 1, "whole seconds, as over HTTP"
    assert int(trailers["grpc-retry-pushback-ms"]) == 1000 * int(trailers["retry-after"])
    for result in results:  # nothing lost from the accepted ones
        assert result.status_code == 200 and result.json()["usage"]["completion_tokens"] == 20
    assert requests.post(f"{env.http_base}/v1/chat/completions", json=CHAT, timeout=30).status_code == 200


def test_retry_after_grows_with_the_queue_ahead_on_both_doors() -> None:
    """Bound 1, requests taking ~1.5 s: while one runs, a place frees every ~1.5 s, so each request
    rejected meanwhile is told to come back later than the one before it, whichever door it came by:
    the hints spread the retries instead of inviting them all back at once."""
    env = GatewayEnv(max_queued=1)
    env.workers[0].delay_s = 0.075  # x 20 tokens

    def rest_hint() -> int:
        response = requests.post(f"{env.http_base}/v1/chat/completions", json=CHAT, timeout=30)
        assert response.status_code == 429
        return int(response.headers["Retry-After"])

    def grpc_hint() -> int:
        with pytest.raises(grpc.RpcError) as info:
            list(inference_pb2_grpc.InferenceStub(channel).Generate(inference_pb2.GenerateRequest(
                model=BASE, text="hi", sampling=common_pb2.SamplingParams(max_tokens=3)), timeout=30))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        return int(dict(info.value.trailing_metadata())["retry-after"])

    slow = {**CHAT, "max_tokens": 20}
    try:
        # One finished request gives the mean latency the hints derive from.
        assert requests.post(f"{env.http_base}/v1/chat/completions", json=slow, timeout=30).status_code == 200
        with concurrent.futures.ThreadPoolExecutor(1) as pool, grpc.insecure_channel(env.grpc_address) as channel:
            holding = pool.submit(requests.post, f"{env.http_base}/v1/chat/completions", json=slow, timeout=30)
            while not env.workers[0].running:
                threading.Event().wait(0.01)
            hints = [rest_hint(), grpc_hint(), rest_hint(), grpc_hint()]
            assert holding.result().status_code == 200
    finally:
        env.close()
    assert hints[0] >= 2, "the first place frees in ~1.5 s"
    assert all(later > earlier for earlier, later in zip(hints, hints[1:])), hints


@pytest.mark.parametrize("slo, param, message", [
    ([50], "tessera_slo", "tessera_slo must be an object"),
    ({"tpot": 50}, "tessera_slo", "unknown fields ['tpot']"),
    ({"tpot_ms": "fast"}, "tessera_slo.tpot_ms", "must be a number"),
    ({"ttft_ms": 0}, "tessera_slo.ttft_ms", "must be a number between 1 and 3600000"),
    ({"ttft_ms": 5e-324}, "tessera_slo.ttft_ms", "must be a number between 1 and 3600000"),
    ({"tpot_ms": -5}, "tessera_slo.tpot_ms", "got -5"),
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


@pytest.mark.parametrize("request_slo, adapter_slo, expected_ms", [
    ((0, 0), (0, 0), (200, 5000)),        # none given: the gateway's defaults
    ((0, 0), (40, 900), (40, 900)),       # the adapter's defaults, from the registry
    ((25, 0), (40, 900), (25, 900)),      # each objective the request names wins over its adapter's
])
def test_each_objective_is_the_requests_else_its_adapters_else_the_gateways(request_slo, adapter_slo, expected_ms):
    adapter = common_pb2.Adapter(name="sql", base_model=BASE, rank=8, tpot_slo_ms=adapter_slo[0],
                                 ttft_slo_ms=adapter_slo[1])
    request = inference_pb2.GenerateRequest(model="sql", text="hi", sampling=common_pb2.SamplingParams(max_tokens=4),
                                            slo=inference_pb2.Slo(tpot_ms=request_slo[0], ttft_ms=request_slo[1]))
    config = GatewayConfig(default_tpot_slo_ms=200, default_ttft_slo_ms=5000)
    slo = routing_request(request, ResolvedModel(BASE, adapter), config).slo
    assert (slo.tpot_s * 1e3, slo.ttft_s * 1e3) == pytest.approx(expected_ms)
