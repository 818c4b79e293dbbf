"""WorkerService over a real grpc.aio server on port 0, with the engine built directly."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from gpu_worker.servicer import WorkerServicer
from services.demo_assets import DEMO_BASE_MODEL
from services.grpc_server import start_grpc_server
from tessera.v1 import common_pb2, worker_pb2, worker_pb2_grpc


async def _with_server(engine, body):
    server = await start_grpc_server(
        "127.0.0.1:0", lambda s: worker_pb2_grpc.add_WorkerServiceServicer_to_server(WorkerServicer(engine), s),
        ["tessera.v1.WorkerService"])
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            return await body(worker_pb2_grpc.WorkerServiceStub(channel))
    finally:
        await server.stop(0)


def _request(tiny_assets, **fields) -> worker_pb2.WorkerGenerateRequest:
    a = tiny_assets.adapters["demo-r16"]
    adapter = common_pb2.Adapter(name=a.name, base_model=a.base_model, rank=a.rank, sha256=a.sha256,
                                 storage_path=a.storage_path)
    return worker_pb2.WorkerGenerateRequest(
        request_id="g1", base_model=DEMO_BASE_MODEL, adapter=adapter, **fields)


def test_generate_streams_deltas_then_final_and_stats(engine_factory, tiny_assets):
    engine = engine_factory()

    async def body(stub):
        request = _request(tiny_assets, chat=common_pb2.ChatPrompt(messages=[
            common_pb2.ChatMessage(role="user", content="Say hi")]), sampling=common_pb2.SamplingParams(max_tokens=6))
        replies = [r async for r in stub.Generate(request)]
        stats = await stub.GetStats(worker_pb2.GetStatsRequest())
        return replies, stats

    replies, stats = asyncio.run(_with_server(engine, body))
    deltas, final = replies[:-1], replies[-1]
    assert all(r.WhichOneof("payload") == "delta" and r.request_id == "g1" for r in deltas)
    assert final.WhichOneof("payload") == "final"
    assert sum(len(r.delta.token_ids) for r in deltas) == final.final.usage.completion_tokens == 6
    assert "".join(r.delta.text for r in deltas) == final.final.text
    assert final.final.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert list(stats.resident_adapters) == ["demo-r16"] and stats.generated_tokens_total == 6


def test_invalid_request_is_invalid_argument(engine_factory, tiny_assets):
    engine = engine_factory()

    async def body(stub):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in stub.Generate(_request(tiny_assets, text="hi", sampling=common_pb2.SamplingParams(max_tokens=10_000))):
                pass
        return err.value

    err = asyncio.run(_with_server(engine, body))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "context" in err.details()


def test_client_cancel_aborts_the_sequence(engine_factory, tiny_assets):
    engine = engine_factory()

    async def body(stub):
        call = stub.Generate(_request(tiny_assets, text="hello", sampling=common_pb2.SamplingParams(max_tokens=200)))
        await call.read()
        call.cancel()
        for _ in range(500):
            if engine.stats().running_requests == 0:
                return engine.stats()
            await asyncio.sleep(0.01)
        return engine.stats()

    stats = asyncio.run(_with_server(engine, body))
    assert stats.running_requests == 0 and stats.generated_tokens_total < 200
