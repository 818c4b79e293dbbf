"""The public gRPC Inference service, through the real gateway to fake workers."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator

import grpc
import pytest

from tests.unit.gateway.gateway_fakes import ADAPTER, BASE, OTHER_BASE, GatewayEnv
from tessera.v1 import common_pb2, inference_pb2, inference_pb2_grpc


@pytest.fixture
def env() -> Iterator[GatewayEnv]:
    env = GatewayEnv()
    yield env
    env.close()


def chat_request(model: str, **sampling: int | list[int]) -> inference_pb2.GenerateRequest:
    return inference_pb2.GenerateRequest(
        model=model, chat=common_pb2.ChatPrompt(messages=[common_pb2.ChatMessage(role="user", content="a b")]),
        sampling=common_pb2.SamplingParams(**sampling))


def test_generate_streams_deltas_then_one_final(env: GatewayEnv, stub: inference_pb2_grpc.InferenceStub) -> None:
    responses = list(stub.Generate(chat_request(ADAPTER, max_tokens=3), timeout=10))
    assert [r.WhichOneof("payload") for r in responses] == ["delta"] * 3 + ["final"]
    assert [list(r.delta.token_ids) for r in responses[:3]] == [[0], [1], [2]]
    final = responses[-1].final
    assert final.text == "w0 w1 w2 " and final.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (2, 3)
    sent = env.workers[0].requests[-1]
    assert sent.adapter.name == ADAPTER and sent.request_id and responses[0].request_id == sent.request_id


def test_stop_token_ids_reach_the_worker(env: GatewayEnv, stub: inference_pb2_grpc.InferenceStub) -> None:
    list(stub.Generate(chat_request(BASE, max_tokens=1, stop_token_ids=[9, 4]), timeout=10))
    assert list(env.workers[0].requests[-1].sampling.stop_token_ids) == [9, 4]


def test_the_request_s_objectives_reach_the_worker_with_the_gateway_s_defaults_filled_in(
        env: GatewayEnv, stub: inference_pb2_grpc.InferenceStub) -> None:
    request = chat_request(BASE, max_tokens=1)
    request.slo.tpot_ms = 40.0
    list(stub.Generate(request, timeout=10))
    sent = env.workers[0].requests[-1]
    assert (sent.tpot_slo_ms, sent.ttft_slo_ms) == (40.0, env.config.gateway.default_ttft_slo_ms)


def test_two_clients_with_the_same_request_id_both_complete_under_ids_the_gateway_assigns(
        env: GatewayEnv, stub: inference_pb2_grpc.InferenceStub) -> None:
    """The client's request_id is a label: the gateway keys (router, worker) by its own ids."""
    env.workers[0].delay_s = 0.02  # long enough for the two streams to overlap
    request = chat_request(BASE, max_tokens=5)
    request.request_id = "same-label"
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        streams = [pool.submit(lambda: list(stub.Generate(request, timeout=10))) for _ in range(2)]
        answers = [s.result() for s in streams]
    assert all([r.WhichOneof("payload") for r in responses] == ["delta"] * 5 + ["final"] for responses in answers)
    ids = [{r.request_id for r in responses} for responses in answers]
    assert all(len(i) == 1 for i in ids) and ids[0] != ids[1] and "same-label" not in ids[0] | ids[1]
    assert {sent.request_id for sent in env.workers[0].requests} == ids[0] | ids[1]


def test_list_models(stub: inference_pb2_grpc.InferenceStub) -> None:
    cards = {c.id: c for c in stub.ListModels(inference_pb2.ListModelsRequest(), timeout=10).models}
    assert set(cards) == {BASE, OTHER_BASE, ADAPTER}
    assert cards[ADAPTER].is_adapter and cards[ADAPTER].base_model == BASE and cards[ADAPTER].rank == 8
    assert not cards[BASE].is_adapter and cards[BASE].base_model == BASE


@pytest.mark.parametrize(("request_", "code", "phrase"), [
    (chat_request(BASE, max_tokens=-1), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens must be"),
    (chat_request(BASE, max_tokens=10_000), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens must be"),
    (chat_request(BASE, stop_token_ids=[-3]), grpc.StatusCode.INVALID_ARGUMENT, "stop_token_ids[0] must be"),
    (chat_request(BASE, stop_token_ids=list(range(65))), grpc.StatusCode.INVALID_ARGUMENT, "at most 64 ids"),
    (inference_pb2.GenerateRequest(model=BASE), grpc.StatusCode.INVALID_ARGUMENT, "a prompt is required"),
    (chat_request(""), grpc.StatusCode.INVALID_ARGUMENT, "model is required"),
    (chat_request("nope"), grpc.StatusCode.NOT_FOUND, "model 'nope' does not exist"),
    (chat_request(OTHER_BASE), grpc.StatusCode.UNAVAILABLE, "no live worker serves base model 'tiny-qwen'"),
])
def test_generate_status_codes(env: GatewayEnv, stub: inference_pb2_grpc.InferenceStub,
                               request_: inference_pb2.GenerateRequest, code: grpc.StatusCode, phrase: str) -> None:
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(request_, timeout=10))
    assert info.value.code() == code
    assert phrase in info.value.details()
    assert env.workers[0].requests == []


def test_worker_dying_mid_stream_is_unavailable(env: GatewayEnv, stub: inference_pb2_grpc.InferenceStub) -> None:
    env.workers[0].fail_after = 1
    received = []
    with pytest.raises(grpc.RpcError) as info:
        for response in stub.Generate(chat_request(BASE, max_tokens=4), timeout=10):
            received.append(response)
    assert len(received) == 1 and received[0].delta.text == "w0 "
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "worker0 crashed" in info.value.details()
