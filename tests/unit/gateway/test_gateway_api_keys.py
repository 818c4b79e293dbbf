"""Client API keys (`gateway.api_keys`) on both front doors of a real gateway (gRPC and REST on
free ports): the same keys, `Bearer <key>`; without one, UNAUTHENTICATED / 401 before any work;
health checks and the OpenAPI document stay open."""

from __future__ import annotations

import hmac
from collections.abc import Iterator

import grpc
import pytest
import requests
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.api_keys import ApiKeys
from tests.unit.gateway.gateway_fakes import BASE, GatewayEnv
from tessera.v1 import common_pb2, inference_pb2, inference_pb2_grpc

KEYS = ["k-secret", "k-other"]
REQUEST = inference_pb2.GenerateRequest(model=BASE, text="hi", sampling=common_pb2.SamplingParams(max_tokens=2))


@pytest.fixture(scope="module")
def env() -> Iterator[GatewayEnv]:
    env = GatewayEnv(api_keys=KEYS)
    yield env
    env.close()


@pytest.fixture(scope="module")
def channel(env: GatewayEnv) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(env.grpc_address) as channel:
        yield channel


def bearer(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


@pytest.mark.parametrize("metadata", [
    (), bearer("wrong"), bearer(""), bearer("k-secretX"), bearer("k-secre"), (("authorization", "k-secret"),),
    (("authorization", "Basic k-secret"),), (("x-api-key", "k-secret"),),
], ids=["none", "wrong", "empty", "longer", "prefix", "no-scheme", "basic", "other-header"])
def test_grpc_without_an_accepted_key_is_unauthenticated(
        env: GatewayEnv, channel: grpc.Channel, metadata: tuple[tuple[str, str], ...]) -> None:
    stub = inference_pb2_grpc.InferenceStub(channel)
    sent_before = len(env.workers[0].requests)
    with pytest.raises(grpc.RpcError) as generate:
        list(stub.Generate(REQUEST, metadata=metadata, timeout=10))
    with pytest.raises(grpc.RpcError) as list_models:
        stub.ListModels(inference_pb2.ListModelsRequest(), metadata=metadata, timeout=10)
    for info in (generate, list_models):
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "send the metadata 'authorization: Bearer <key>'" in info.value.details()
    assert len(env.workers[0].requests) == sent_before, "refused before any work"


def test_grpc_unauthenticated_request_is_refused_before_it_is_parsed(channel: grpc.Channel) -> None:
    """Bytes that are no GenerateRequest at all: the missing key is what the caller hears."""
    with pytest.raises(grpc.RpcError) as info:
        list(channel.unary_stream("/tessera.v1.Inference/Generate")(b"\xff\xff\xff", timeout=10))
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize("key", KEYS)
def test_grpc_with_either_key_is_served(env: GatewayEnv, channel: grpc.Channel, key: str) -> None:
    stub = inference_pb2_grpc.InferenceStub(channel)
    responses = list(stub.Generate(REQUEST, metadata=bearer(key), timeout=10))
    assert responses[-1].final.text == "w0 w1 "
    assert BASE in {card.id for card in stub.ListModels(inference_pb2.ListModelsRequest(), metadata=bearer(key),
                                                        timeout=10).models}
    lowercase_scheme = (("authorization", f"bearer {key}"),)
    assert stub.ListModels(inference_pb2.ListModelsRequest(), metadata=lowercase_scheme, timeout=10).models


def test_grpc_health_stays_open_for_probes(channel: grpc.Channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "tessera.v1.Inference"):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_rest_takes_the_same_keys_and_leaves_health_and_the_schema_open(env: GatewayEnv) -> None:
    models = f"{env.http_base}/v1/models"
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "k-secret"}):
        response = requests.get(models, headers=headers, timeout=10)
        assert response.status_code == 401 and response.json()["error"]["type"] == "authentication_error"
        assert "send the header 'Authorization: Bearer <key>'" in response.json()["error"]["message"]
    for key in KEYS:
        assert requests.get(models, headers={"Authorization": f"Bearer {key}"}, timeout=10).status_code == 200
    assert requests.get(f"{env.http_base}/healthz", timeout=10).status_code == 200
    assert requests.get(f"{env.http_base}/openapi.json", timeout=10).json()["openapi"].startswith("3.1")


def test_every_key_is_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each check runs hmac.compare_digest against every configured key, whether the first, the
    last or none matches, so neither which key nor how much of it matched shows in the time."""
    compared: list[tuple[bytes, bytes]] = []
    original = hmac.compare_digest

    def compare_digest(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return original(a, b)

    monkeypatch.setattr("gateway.api_keys.hmac.compare_digest", compare_digest)
    keys = ApiKeys(["first", "second", "third"])
    for header, accepted in (("Bearer first", True), ("Bearer third", True), ("Bearer fourth", False),
                             ("Bearer firs", False), (None, False)):
        compared.clear()
        assert keys.accepts(header) is accepted
        assert len(compared) == 3
        assert len({len(a) for a, _ in compared} | {len(b) for _, b in compared}) == 1, "digests of one length"
