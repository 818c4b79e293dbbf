"""Benchmark requests through a running Engine, as the gRPC servicer sends them: submitted from an
asyncio loop in the caller's thread, every stream drained to its end. Three ways to send them: all at
once (`serve`), each at its time (`replay`), or one to its first token (`first_token_s`)."""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast, ProcessorMixin

from gpu_worker.builder import EngineParts
from gpu_worker.delivery import RequestHandle
from gpu_worker.engine import Engine, StepRecord
from gpu_worker.intake import GenerationRequest
from gpu_worker.profile import random_adapter_ref
from gpu_worker.sequence import SamplingParams
from services.demo_assets import build_tokenizer

BASE_MODEL = "bench"
BENCH_TOKEN_PREFIX = "<bench_"  # the added tokens that pad bench_tokenizer's vocabulary


def bench_tokenizer(vocab_size: int | None = None) -> PreTrainedTokenizerFast:
    """The locally trained demo tokenizer, padded with added tokens to `vocab_size` (so that every id a
    random model of that vocabulary samples decodes), without EOS: requests run to max_tokens."""
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = build_tokenizer(Path(tmp) / "tokenizer")
    if vocab_size is not None:
        assert vocab_size >= len(tokenizer), (vocab_size, len(tokenizer))
        tokenizer.add_tokens([f"{BENCH_TOKEN_PREFIX}{i}>" for i in range(vocab_size - len(tokenizer))])
    tokenizer.eos_token = None
    return tokenizer


def bench_request(request_id: str, prompt: str, max_tokens: int, adapter: str | None, rank: int) -> GenerationRequest:
    ref = random_adapter_ref(adapter, BASE_MODEL, rank) if adapter else None
    return GenerationRequest(request_id, prompt, SamplingParams(max_tokens=max_tokens), ref)


@contextmanager
def running_engine(parts: EngineParts, tokenizer: PreTrainedTokenizerBase, max_lora_rank: int, async_scheduling: bool,
                   on_step: Callable[[StepRecord], None] | None = None, processor: ProcessorMixin | None = None,
                   base_model: str = BASE_MODEL) -> Iterator[Engine]:
    """An engine over `parts` (`processor`: a vision model's, for requests with images), stopped on exit.
    One at a time: two running engines would share a scheduler."""
    engine = Engine(base_model=base_model, runner=parts.runner, scheduler=parts.scheduler,
                    orchestrator=parts.orchestrator, adapters=parts.adapters, cold_start=parts.cold_start,
                    tokenizer=tokenizer, processor=processor, max_context=parts.model.max_context,
                    max_lora_rank=max_lora_rank, async_scheduling=async_scheduling, on_step=on_step)
    engine.start()
    try:
        yield engine
    finally:
        engine.stop()


def serve(engine: Engine, requests: list[GenerationRequest]) -> float:
    """Submit every request at once and drain each stream; seconds until the last one ended."""
    async def run() -> None:
        loop = asyncio.get_running_loop()
        handles = [engine.submit(request, loop) for request in requests]

        async def drain(handle: RequestHandle) -> None:
            async for _ in handle:
                pass
        await asyncio.gather(*map(drain, handles))

    started = time.perf_counter()
    asyncio.run(run())
    return time.perf_counter() - started


async def first_token_s(engine: Engine, request: GenerationRequest) -> float:
    """Seconds from submitting `request` to its first token; the stream is drained to its end."""
    started, first = time.perf_counter(), None
    async for out in engine.submit(request, asyncio.get_running_loop()):
        if first is None and out.token_ids:
            first = time.perf_counter() - started
    assert first is not None, f"{request.request_id} ended without a token"
    return first


async def replay(engine: Engine, requests: list[tuple[float, GenerationRequest]]) -> list[dict]:
    """Submit each request at its time (seconds from now); -> per request: TTFT, TPOT (s; None with one
    token), tokens."""
    loop = asyncio.get_running_loop()
    start = time.perf_counter()

    async def one(at_s: float, request: GenerationRequest) -> dict:
        await asyncio.sleep(max(0.0, start + at_s - time.perf_counter()))
        submitted, first, last, tokens = time.perf_counter(), None, None, 0
        async for out in engine.submit(request, loop):
            if out.token_ids:
                last = time.perf_counter()
                first = first or last
                tokens += len(out.token_ids)
        assert first is not None, f"{request.request_id} ended without a token"
        return dict(ttft_s=first - submitted, tpot_s=(last - first) / (tokens - 1) if tokens > 1 else None,
                    tokens=tokens)
    return await asyncio.gather(*(one(at_s, request) for at_s, request in requests))
