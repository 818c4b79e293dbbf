"""Routing by task (docs/fuse.md): a `model` of "task:<name>" resolves to the newest adapter whose `tasks`
name it, through both doors, for generation and classify; GET /v1/models lists each task."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import grpc
import pytest
import requests

from gateway.registry_cache import RegistryCache
from services.common.errors import NotFound
from tests.unit.gateway.gateway_fakes import BASE, CLASSIFIER, GatewayEnv, start_fake_server, with_head_adapters
from tests.unit.gateway.test_gateway_registry_cache import WatchedRegistry, _until
from tessera.v1 import common_pb2, inference_pb2, inference_pb2_grpc, registry_pb2_grpc

SHAPES, SHAPES_V2 = "shapes-fused", "shapes-fused-v2"  # v2 registered later, serving "shape" again


def task(name: str) -> common_pb2.AdapterTask:
    return common_pb2.AdapterTask(name=name, accuracy=0.95, metric="accuracy")


@pytest.fixture
def env() -> Iterator[GatewayEnv]:
    env = with_head_adapters(GatewayEnv())
    env.registry.adapters += [
        common_pb2.Adapter(name=SHAPES, base_model=BASE, rank=4, alpha=8.0, sha256="ef" * 32, created_unix=400,
                           created_unix_ms=400_000, tasks=[task("shape"), task("colour")]),
        common_pb2.Adapter(name=SHAPES_V2, base_model=BASE, rank=8, alpha=16.0, sha256="12" * 32, created_unix=500,
                           created_unix_ms=500_000, tasks=[task("shape")])]
    for adapter in env.registry.adapters:
        if adapter.name == CLASSIFIER:
            adapter.tasks.append(task("sentiment"))
    assert env.refresh()
    yield env
    env.close()


def chat(env: GatewayEnv, model: str) -> requests.Response:
    return requests.post(f"{env.http_base}/v1/chat/completions", timeout=30, json={
        "model": model, "messages": [{"role": "user", "content": "what shape?"}], "max_tokens": 2})


def test_rest_chat_by_task_runs_on_the_adapter_serving_it_and_echoes_the_task(env: GatewayEnv) -> None:
    response = chat(env, "task:colour")
    assert response.status_code == 200, response.text
    assert response.json()["model"] == "task:colour"
    assert response.json()["choices"][0]["message"]["content"] == "w0 w1 "
    sent = env.workers[0].requests[-1]
    assert (sent.adapter.name, sent.base_model) == (SHAPES, BASE)


def test_a_task_two_adapters_serve_goes_to_the_newer_registration(env: GatewayEnv) -> None:
    assert chat(env, "task:shape").status_code == 200
    assert env.workers[0].requests[-1].adapter.name == SHAPES_V2


def test_a_deleted_adapters_tasks_go_back_to_the_older_one_when_the_registry_announces_it() -> None:
    async def scenario() -> None:
        registry = WatchedRegistry()
        registry.adapters += [
            common_pb2.Adapter(name=SHAPES, base_model=BASE, created_unix_ms=400_000, tasks=[task("shape")]),
            common_pb2.Adapter(name=SHAPES_V2, base_model=BASE, created_unix_ms=500_000, tasks=[task("shape")])]
        server, port = await start_fake_server(registry, registry_pb2_grpc.add_RegistryServicer_to_server)
        # No refresh for a minute: only the change feed can tell.
        cache = RegistryCache(f"127.0.0.1:{port}", refresh_s=60, miss_refresh_interval_s=60)
        await cache.start()
        try:
            await asyncio.wait_for(registry.watching.wait(), 5)
            assert (await cache.resolve("task:shape")).adapter.name == SHAPES_V2
            registry.delete(SHAPES_V2)
            await _until(lambda: SHAPES_V2 not in cache._snapshot.adapters)
            assert (await cache.resolve("task:shape")).adapter.name == SHAPES
            registry.delete(SHAPES)
            await _until(lambda: SHAPES not in cache._snapshot.adapters)
            with pytest.raises(NotFound, match="task 'shape' is served by no adapter"):
                await cache.resolve("task:shape")
        finally:
            await cache.close()
            await server.stop(0)

    asyncio.run(scenario())


def test_grpc_generate_by_task(env: GatewayEnv, stub: inference_pb2_grpc.InferenceStub) -> None:
    request = inference_pb2.GenerateRequest(model="task:shape", text="a b",
                                            sampling=common_pb2.SamplingParams(max_tokens=3))
    responses = list(stub.Generate(request, timeout=10))
    assert responses[-1].final.text == "w0 w1 w2 "
    assert env.workers[0].requests[-1].adapter.name == SHAPES_V2


def test_classify_by_task_answers_with_the_adapters_head(env: GatewayEnv,
                                                          stub: inference_pb2_grpc.InferenceStub) -> None:
    response = requests.post(f"{env.http_base}/v1/classify", json={"model": "task:sentiment", "input": ["a b"]},
                             timeout=30)
    assert response.status_code == 200, response.text
    assert response.json()["data"][0]["label"] == "positive"  # 2 words: label 2 (gateway_fakes.fake_head_output)
    answer = stub.Classify(inference_pb2.ClassifyRequest(
        model="task:sentiment", inputs=[inference_pb2.ClassifyInput(text="a")]), timeout=10)
    assert answer.results[0].label == "neutral"
    assert env.workers[0].requests[-1].adapter.name == CLASSIFIER


def test_an_unknown_task_is_404_naming_it(env: GatewayEnv, stub: inference_pb2_grpc.InferenceStub) -> None:
    response = chat(env, "task:odd-one-out")
    assert response.status_code == 404
    error = response.json()["error"]
    assert "task 'odd-one-out' is served by no adapter" in error["message"] and error["param"] == "model"
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(inference_pb2.GenerateRequest(model="task:odd-one-out", text="a"), timeout=10))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND and "odd-one-out" in info.value.details()
    # An adapter's name is not a task's.
    assert chat(env, f"task:{SHAPES}").status_code == 404


def test_models_lists_each_task_with_its_adapter_as_parent(env: GatewayEnv,
                                                           stub: inference_pb2_grpc.InferenceStub) -> None:
    by_id = {m["id"]: m for m in requests.get(f"{env.http_base}/v1/models", timeout=10).json()["data"]}
    assert by_id["task:shape"] == {"id": "task:shape", "object": "model", "created": 500, "owned_by": "tessera",
                                   "root": BASE, "parent": SHAPES_V2}
    assert by_id["task:colour"]["parent"] == SHAPES and by_id["task:sentiment"]["parent"] == CLASSIFIER
    assert by_id[SHAPES]["parent"] == BASE and by_id[BASE]["parent"] is None
    cards = {c.id: c for c in stub.ListModels(inference_pb2.ListModelsRequest(), timeout=10).models}
    assert [c for c in cards if c.startswith("task:")] == ["task:colour", "task:sentiment", "task:shape"]
    shape = cards["task:shape"]
    assert (shape.parent, shape.base_model, shape.rank, shape.is_adapter) == (SHAPES_V2, BASE, 8, True)
