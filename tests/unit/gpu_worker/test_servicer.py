"""WorkerService over a real grpc.aio server on port 0, with the engine built directly."""

from __future__ import annotations

import asyncio
import time
import json

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry
from transformers import AutoTokenizer

from gpu_worker.metrics import CacheMetrics
from gpu_worker.prompts import ChatMessage, ImagePart
from gpu_worker.servicer import WorkerServicer, generation_request, worker_stats
from gpu_worker.state_push import StateSource
from services.demo_assets import DEMO_BASE_MODEL
from services.common.config import load_config
from services.common.errors import InvalidArgument
from services.common.grpc_server import start_grpc_server
from policy.perf_model import PerfModel, perf_model_path
from services.common.tls import load_role_credentials
from services.common.tls_issue import ensure_cluster_certs
from tessera.v1 import common_pb2, worker_pb2, worker_pb2_grpc

from .conftest import idle_stats

PERF_MODEL = PerfModel.load(perf_model_path("cpu-tessera-demo-llama"))


async def _with_server(engine, body):
    server = await start_grpc_server(
        "127.0.0.1:0", lambda s: worker_pb2_grpc.add_WorkerServiceServicer_to_server(
            WorkerServicer(engine, StateSource(engine, PERF_MODEL, max_batch=32)), s),
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
        # Stats are published at the end of the engine step, which may come after the final reply.
        for _ in range(500):
            stats = await stub.GetStats(worker_pb2.GetStatsRequest())
            if stats.running_requests == 0:
                break
            await asyncio.sleep(0.01)
        return replies, stats

    replies, stats = asyncio.run(_with_server(engine, body))
    deltas, final = replies[:-1], replies[-1]
    assert all(r.WhichOneof("payload") == "delta" for r in deltas)
    assert final.WhichOneof("payload") == "final"
    assert len({r.request_id for r in replies}) == 1 and replies[0].request_id != "g1", "the worker's own id"
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


def test_two_callers_with_the_same_request_id_get_independent_requests_under_the_workers_ids(
        engine_factory, tiny_assets):
    """The caller's request_id is a label: one caller cancelling does not touch the other's request."""
    engine = engine_factory()

    async def body(stub):
        request = _request(tiny_assets, text="hello", sampling=common_pb2.SamplingParams(max_tokens=200))
        cancelled = stub.Generate(request)
        first = await cancelled.read()
        request.sampling.max_tokens = 8
        completed = stub.Generate(request)  # same request_id "g1", while the first one runs
        replies = [await completed.read()]
        cancelled.cancel()
        while (reply := await completed.read()) is not grpc.aio.EOF:
            replies.append(reply)
        return first, replies

    first, replies = asyncio.run(_with_server(engine, body))
    final = replies[-1].final
    assert final.finish_reason == common_pb2.FINISH_REASON_LENGTH and final.usage.completion_tokens == 8
    assert sum(len(r.delta.token_ids) for r in replies[:-1]) == 8
    ids = {r.request_id for r in replies}
    assert len(ids) == 1 and first.request_id not in ids and "g1" not in ids | {first.request_id}
    assert idle_stats(engine).running_requests == 0


def test_logprobs_stream_with_each_token_and_its_text(engine_factory, tiny_assets):
    engine = engine_factory()

    async def body(stub):
        sampling = common_pb2.SamplingParams(max_tokens=5, logprobs=3)
        return [r async for r in stub.Generate(_request(tiny_assets, text="hello", sampling=sampling))]

    deltas = [r.delta for r in asyncio.run(_with_server(engine, body)) if r.HasField("delta")]
    entries = [e for d in deltas for e in d.logprobs]
    assert [e.token_id for e in entries] == [t for d in deltas for t in d.token_ids] and len(entries) == 5
    for e in entries:
        top = [(t.token_id, t.logprob) for t in e.top_logprobs]
        assert len(top) == 3 and [v for _, v in top] == sorted((v for _, v in top), reverse=True)
        assert top[0] == (e.token_id, e.logprob), "greedy: the chosen token is the most likely one"
        assert [e.token, *(t.token for t in e.top_logprobs)] == engine.token_texts(
            [e.token_id, *(i for i, _ in top)])


def test_no_logprobs_unless_asked_and_out_of_range_is_invalid(engine_factory, tiny_assets):
    engine = engine_factory()

    async def body(stub):
        plain = [r async for r in stub.Generate(_request(
            tiny_assets, text="hello", sampling=common_pb2.SamplingParams(max_tokens=2)))]
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in stub.Generate(_request(
                    tiny_assets, text="hello", sampling=common_pb2.SamplingParams(max_tokens=2, logprobs=21))):
                pass
        return plain, err.value

    plain, err = asyncio.run(_with_server(engine, body))
    assert all(not r.delta.logprobs for r in plain if r.HasField("delta"))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "logprobs must be between 0 and 20" in err.details()


def test_token_texts_decode_each_id_alone(engine_factory, tiny_assets):
    engine = engine_factory()
    tokenizer = AutoTokenizer.from_pretrained(tiny_assets.base_dir)
    ids = tokenizer("def main(): pass").input_ids + [tokenizer.eos_token_id]
    assert engine.token_texts(ids) == [tokenizer.decode([i], skip_special_tokens=False) for i in ids]
    assert engine.token_texts([tokenizer.eos_token_id]) == [tokenizer.eos_token]


def test_stop_token_ids_stop_the_stream_and_out_of_vocabulary_is_invalid(engine_factory, tiny_assets):
    engine = engine_factory()

    async def generate(stub, **sampling):
        request = _request(tiny_assets, text="hello", sampling=common_pb2.SamplingParams(max_tokens=8, **sampling))
        return [r async for r in stub.Generate(request)]

    async def body(stub):
        free = await generate(stub)
        tokens = [t for r in free if r.HasField("delta") for t in r.delta.token_ids]
        stopped = await generate(stub, stop_token_ids=[tokens[1]])
        errors = []
        for bad in ([engine.vocab_size], [0, -1]):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await generate(stub, stop_token_ids=bad)
            errors.append(err.value)
        return tokens, stopped, errors

    tokens, stopped, errors = asyncio.run(_with_server(engine, body))
    assert len(tokens) == 8
    end = tokens.index(tokens[1]) + 1
    assert [t for r in stopped if r.HasField("delta") for t in r.delta.token_ids] == tokens[:end]
    final = stopped[-1].final
    assert final.finish_reason == common_pb2.FINISH_REASON_STOP and final.usage.completion_tokens == end
    assert all(e.code() == grpc.StatusCode.INVALID_ARGUMENT for e in errors)
    assert f"stop_token_ids[0] is {engine.vocab_size}, outside this model's vocabulary [0, {engine.vocab_size})" \
        in errors[0].details()
    assert "stop_token_ids[1] is -1" in errors[1].details()


def test_watch_state_pushes_the_running_batch_and_resident_adapters(engine_factory, tiny_assets):
    engine = engine_factory()

    async def body(stub):
        call = stub.Generate(_request(tiny_assets, text="hello", sampling=common_pb2.SamplingParams(max_tokens=200)))
        await call.read()  # running now, with demo-r16 in a slot
        states = stub.WatchState(worker_pb2.WatchStateRequest(interval_ms=10))
        first, busy = [await states.read() for _ in range(2)]
        assert PerfModel.from_json(json.loads(first.perf_model_spec)) == PERF_MODEL  # the stream's first state
        assert busy.perf_model_spec == ""  # ... alone carries the model
        call.cancel()
        state = busy
        while state.running:  # pushed again and again: the abort shows within a few intervals
            state = await states.read()
        states.cancel()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in stub.WatchState(worker_pb2.WatchStateRequest(interval_ms=5)):
                pass
        return busy, state, err.value

    started = time.monotonic()
    busy, idle, err = asyncio.run(_with_server(engine, body))
    elapsed = time.monotonic() - started
    assert busy.base_model == DEMO_BASE_MODEL and busy.perf_model == PERF_MODEL.kind and busy.max_batch == 32
    (entry,) = busy.running
    assert entry.adapter == "demo-r16" and entry.rank == 16 and entry.tokens > 1
    assert list(busy.gpu_adapters) == ["demo-r16"] and not busy.queued
    assert not idle.running and idle.free_kv_tokens > busy.free_kv_tokens
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "interval_ms must be between 10 and 1000" in err.details()
    # What the heartbeat tells the registry's placement planner: the tiers' budgets and each adapter's requests.
    stats = worker_stats(engine)
    assert [(r.adapter, r.requests) for r in stats.adapter_requests_total] == [("demo-r16", 1)]
    assert 0 < stats.busy_seconds_total < elapsed  # it stepped, and idled after the abort
    tiers = engine.stats().adapters
    budgets = (stats.adapter_gpu_bytes, stats.adapter_host_bytes)
    assert budgets == (tiers.gpu_capacity_bytes, tiers.host_capacity_bytes) and min(budgets) > 0


def test_content_parts_become_text_and_images_in_order():
    parts = [common_pb2.ContentPart(text="Look: "), common_pb2.ContentPart(image=b"png-1"),
             common_pb2.ContentPart(image=b"png-2"), common_pb2.ContentPart(text=" which?")]
    request = worker_pb2.WorkerGenerateRequest(chat=common_pb2.ChatPrompt(messages=[
        common_pb2.ChatMessage(role="system", content="Be brief."), common_pb2.ChatMessage(role="user", parts=parts)]))
    prompt = generation_request(request, vocab_size=100).prompt
    assert prompt == (ChatMessage("system", "Be brief."),
                      ChatMessage("user", ("Look: ", ImagePart(b"png-1"), ImagePart(b"png-2"), " which?")))
    request.chat.messages[1].content = "and text"
    with pytest.raises(InvalidArgument, match=r"messages\[1\] has both content and parts"):
        generation_request(request, vocab_size=100)


def test_get_stats_counts_prefix_cache_hits_and_queries(engine_factory, tiny_assets):
    """The same prompt twice: the second takes all its whole blocks but the last token's from the cache."""
    engine = engine_factory(kv_block_size=16)
    prompt = "You are a careful reviewer of Python code. Read the function below, then answer in one sentence. " * 2

    async def body(stub):
        finals = []
        for request_id in ("first", "again"):
            request = _request(tiny_assets, text=prompt, sampling=common_pb2.SamplingParams(max_tokens=2))
            request.request_id = request_id
            finals.append([r async for r in stub.Generate(request)][-1].final)
        return finals, await stub.GetStats(worker_pb2.GetStatsRequest())

    (first, again), stats = asyncio.run(_with_server(engine, body))
    prompt_tokens = first.usage.prompt_tokens
    assert prompt_tokens == again.usage.prompt_tokens >= 3 * 16
    assert stats.prefix_cache_hit_tokens_total == (prompt_tokens - 1) // 16 * 16
    assert stats.prefix_cache_query_tokens_total == 2 * prompt_tokens
    assert stats.prefix_cache_blocks >= prompt_tokens // 16 and stats.prefix_cache_evicted_blocks_total == 0
    assert (stats.image_cache_capacity_bytes, stats.image_cache_hits_total) == (0, 0), "a text model has none"
    metrics = CollectorRegistry()  # what the worker's /metrics shows (bind_engine_stats registers the same)
    metrics.register(CacheMetrics(engine))
    assert metrics.get_sample_value("tessera_worker_prefix_cache_hit_tokens_total") == \
        stats.prefix_cache_hit_tokens_total
    assert metrics.get_sample_value("tessera_worker_prefix_cache_query_tokens_total") == 2 * prompt_tokens
    assert metrics.get_sample_value("tessera_worker_prefix_cache_blocks") == stats.prefix_cache_blocks


def test_only_the_gateways_certificate_reaches_the_workers_methods(engine_factory, tiny_assets, tmp_path):
    """Mutual TLS as the worker serves it: the registry's or another worker's cluster certificate is
    refused every WorkerService method; the gateway's gets through; the health service answers all."""
    config = load_config(environ={"TESSERA_HOME": str(tmp_path)})
    ensure_cluster_certs(config)
    engine = engine_factory()
    generate = _request(tiny_assets, text="hi", sampling=common_pb2.SamplingParams(max_tokens=2))

    async def main() -> list[common_pb2.GenerateResponse]:
        replies = []
        server = await start_grpc_server(
            "127.0.0.1:0", lambda s: worker_pb2_grpc.add_WorkerServiceServicer_to_server(
                WorkerServicer(engine, StateSource(engine, PERF_MODEL, max_batch=32)), s),
            ["tessera.v1.WorkerService"], load_role_credentials(config, "worker").server())
        address = f"127.0.0.1:{server.port}"
        try:
            for role in ("registry", "worker", "gateway"):
                async with grpc.aio.secure_channel(address, load_role_credentials(config, role).channel()) as ch:
                    stub = worker_pb2_grpc.WorkerServiceStub(ch)
                    health = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
                    assert health.status == health_pb2.HealthCheckResponse.SERVING, role
                    if role == "gateway":
                        replies = [r async for r in stub.Generate(generate, timeout=30)]
                        assert replies[-1].WhichOneof("payload") == "final"
                        await stub.GetStats(worker_pb2.GetStatsRequest(), timeout=5)
                        continue
                    for call in (stub.Generate(generate, timeout=5).read(),
                                 stub.WatchState(worker_pb2.WatchStateRequest(interval_ms=50), timeout=5).read(),
                                 stub.GetStats(worker_pb2.GetStatsRequest(), timeout=5)):
                        with pytest.raises(grpc.aio.AioRpcError) as err:
                            await call
                        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, role
                        assert f"tessera-{role}" in err.value.details() and "tessera-gateway" in err.value.details()
        finally:
            await server.stop(0)
        return replies

    replies = asyncio.run(main())
    # The gateway's request alone ran.
    assert idle_stats(engine).generated_tokens_total == sum(len(r.delta.token_ids) for r in replies) > 0


def test_the_gateways_objectives_reach_the_sequence_and_bad_ones_are_invalid(tiny_assets):
    request = generation_request(_request(tiny_assets, text="hi", tpot_slo_ms=40.0, ttft_slo_ms=900.0), vocab_size=100)
    assert request.tpot_slo_s == pytest.approx(0.04)
    assert generation_request(_request(tiny_assets, text="hi"), vocab_size=100).tpot_slo_s is None  # 0: none
    for bad in (dict(tpot_slo_ms=-1.0), dict(ttft_slo_ms=float("nan")), dict(tpot_slo_ms=float("inf"))):
        with pytest.raises(InvalidArgument, match="slo_ms"):
            generation_request(_request(tiny_assets, text="hi", **bad), vocab_size=100)
