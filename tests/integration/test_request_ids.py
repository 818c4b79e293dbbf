"""Request ids are the servers': clients that send the same request_id, to the gateway or to a worker,
get independent requests, each under an id its server assigned."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import pytest

from tessera.v1 import common_pb2, inference_pb2, inference_pb2_grpc, worker_pb2, worker_pb2_grpc

pytestmark = pytest.mark.integration

BASE = "tessera-demo-llama"
LABEL = "my-request"
PROMPT = "Write one line about adapters."
MAX_TOKENS = 16


def _gateway(system) -> tuple[grpc.Channel, Callable[[int], object]]:
    channel = grpc.insecure_channel(system.gateway_grpc)
    stub = inference_pb2_grpc.InferenceStub(channel)
    return channel, lambda max_tokens: stub.Generate(inference_pb2.GenerateRequest(
        model=BASE, text=PROMPT, request_id=LABEL, sampling=common_pb2.SamplingParams(max_tokens=max_tokens)),
        timeout=120)


def _worker(system) -> tuple[grpc.Channel, Callable[[int], object]]:
    channel = system.internal_channel(system.worker_grpc)
    stub = worker_pb2_grpc.WorkerServiceStub(channel)
    return channel, lambda max_tokens: stub.Generate(worker_pb2.WorkerGenerateRequest(
        base_model=BASE, text=PROMPT, request_id=LABEL, sampling=common_pb2.SamplingParams(max_tokens=max_tokens)),
        timeout=120)


@pytest.mark.parametrize("front_door", [_gateway, _worker], ids=["gateway", "worker"])
def test_a_shared_request_id_is_a_label_and_cancelling_one_request_spares_the_other(system, front_door):
    channel, generate = front_door(system)
    with channel:
        alone = list(generate(MAX_TOKENS))
        cancelled = generate(10 * MAX_TOKENS)
        first = next(cancelled)  # running now
        shared = generate(MAX_TOKENS)
        replies = [next(shared)]  # both in flight under the same label
        cancelled.cancel()
        replies += list(shared)
    assert replies[-1].final.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert [r.delta.token_ids for r in replies[:-1]] == [r.delta.token_ids for r in alone[:-1]], "greedy: same tokens"
    ids = [{r.request_id for r in answer} for answer in (alone, replies)]
    assert all(len(i) == 1 for i in ids) and len(ids[0] | ids[1] | {first.request_id}) == 3
    assert LABEL not in ids[0] | ids[1]
