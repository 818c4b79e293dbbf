"""Tokenization runs off the worker's event loop: a huge prompt delays only itself.

WorkerService over a real grpc.aio server on port 0, in front of an engine of the demo model's size
(the tiny test model's steps are too short to read gaps from). Other streams decode while one
client sends a 999,000-character prompt, which is over the model's context: its rejection,
tokenization included, must not stall them.

What is asserted is robust on a loaded 2-core machine: the other streams' longest gap between two
tokens while the huge prompt is in intake, against the time that intake takes. With tokenization on
the event loop the two are equal (every stream waits for the whole tokenization); off the loop the
gap stays near a decode step. A p99-against-an-idle-run ratio is not asserted: on 2 cores the
intake thread takes a core from the engine for the whole tokenization, and the end of a
tokenization holds the GIL for a few tens of milliseconds (its token ids become Python lists and its
Rust encoding is freed), so that ratio swings with the machine's load.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from gpu_worker.delivery import RequestHandle
from gpu_worker.engine import Engine
from gpu_worker.intake import GenerationRequest
from gpu_worker.servicer import WorkerServicer
from gpu_worker.sequence import SamplingParams
from gpu_worker.state_push import StateSource
from services.common.grpc_server import start_grpc_server
from services.demo_assets import LlamaShape, build_llama
from tessera.v1 import common_pb2, worker_pb2, worker_pb2_grpc

from .conftest import TinyAssets, idle_stats, make_engine

HUGE_PROMPT = ("def area(width, height):\n    return width * height  # a rectangle's area\n" * 15_000)[:999_000]
STREAM_PROMPTS = ("Once upon a time", "import os\nimport sys\n", "class Point:\n    def __init__(self")


@pytest.fixture(scope="module")
def demo_engine(tiny_assets, tmp_path_factory) -> Iterator[Engine]:
    base = build_llama(tmp_path_factory.mktemp("demo") / "base", tokenizer_dir=tiny_assets.base_dir,
                       shape=LlamaShape())
    engine = make_engine(TinyAssets(base, tiny_assets.store, {}))
    yield engine
    engine.stop()


def _request(text: str, max_tokens: int) -> worker_pb2.WorkerGenerateRequest:
    return worker_pb2.WorkerGenerateRequest(text=text, sampling=common_pb2.SamplingParams(max_tokens=max_tokens))


async def _stream(stub: worker_pb2_grpc.WorkerServiceStub, prompt: str, arrivals: list[float]) -> None:
    async for reply in stub.Generate(_request(prompt, 1500)):
        if reply.HasField("delta"):
            arrivals.append(time.perf_counter())


async def _huge_prompt_beside_streams(stub: worker_pb2_grpc.WorkerServiceStub):
    """-> (the huge request's error, its start and end, each other stream's token arrival times)."""
    arrivals: list[list[float]] = [[] for _ in STREAM_PROMPTS]
    streams = [asyncio.create_task(_stream(stub, p, a)) for p, a in zip(STREAM_PROMPTS, arrivals)]
    while min(map(len, arrivals)) < 5:  # every stream decoding
        await asyncio.sleep(0.005)
    start = time.perf_counter()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in stub.Generate(_request(HUGE_PROMPT, 16)):
            pass
    end = time.perf_counter()
    while min(a[-1] for a in arrivals) <= end:  # a token after the rejection closes every gap it spans
        assert not any(s.done() for s in streams), "a stream ended before the measurement did"
        await asyncio.sleep(0.005)
    for s in streams:
        s.cancel()
    await asyncio.gather(*streams, return_exceptions=True)
    return err.value, start, end, arrivals


def test_a_huge_prompt_is_rejected_without_stalling_the_other_streams(demo_engine):
    async def body():
        server = await start_grpc_server("127.0.0.1:0", lambda s: worker_pb2_grpc.add_WorkerServiceServicer_to_server(
            WorkerServicer(demo_engine, StateSource(demo_engine, "cpu-tessera-demo-llama", max_batch=32)), s),
            ["tessera.v1.WorkerService"])
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                return await _huge_prompt_beside_streams(worker_pb2_grpc.WorkerServiceStub(channel))
        finally:
            await server.stop(0)

    error, start, end, arrivals = asyncio.run(body())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "context" in error.details(), error
    gaps = [b - a for times in arrivals for a, b in zip(times, times[1:]) if b > start and a < end]
    intake_s = end - start
    assert intake_s > 0.2, f"the huge prompt took {intake_s:.3f} s: too fast to tell a stall from a step"
    assert max(gaps) < intake_s / 4, \
        f"another stream waited {max(gaps) * 1e3:.0f} ms while the huge prompt took {intake_s * 1e3:.0f} ms"


def test_a_caller_cancelled_during_intake_leaves_no_request_behind(engine_factory, monkeypatch):
    engine = engine_factory()
    queued = threading.Event()  # set once the intake thread has handed the request to the engine
    submit = engine.submit

    def submit_and_signal(request: GenerationRequest, loop: asyncio.AbstractEventLoop) -> RequestHandle:
        handle = submit(request, loop)
        queued.set()
        return handle
    monkeypatch.setattr(engine, "submit", submit_and_signal)

    async def body():
        submitting = asyncio.create_task(engine.submit_async(
            GenerationRequest("gone", "hello", SamplingParams(max_tokens=200))))
        await asyncio.sleep(0)  # in intake now
        submitting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await submitting
        assert await asyncio.to_thread(queued.wait, 10)
        await asyncio.sleep(0.01)  # the loop runs the abort it scheduled

    asyncio.run(body())
    stats = idle_stats(engine)
    assert stats.running_requests == stats.waiting_requests == 0
    assert stats.generated_tokens_total < 200, "the request ran to its end with nobody listening"
