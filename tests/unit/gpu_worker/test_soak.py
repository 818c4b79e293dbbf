"""Soak: hundreds of requests with random adapters, lengths, sampling and cancellations through one
engine with a small KV pool (so preemption happens). Nothing may be lost or duplicated, and every
KV block and adapter pin must come back."""

from __future__ import annotations

import asyncio
import random

from gpu_worker.delivery import RequestOutput
from gpu_worker.intake import GenerationRequest
from gpu_worker.sequence import FinishReason, SamplingParams

from .conftest import idle_stats

NUM_REQUESTS = 240
KV_TOKENS = 512
WORDS = ("def", "return", "self", "import", "class", "value", "(", ")", ":", "\n", "    ", "x", "=", "1")


def _random_request(rng: random.Random, index: int, adapters) -> GenerationRequest:
    prompt = "".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40)))
    params = SamplingParams(max_tokens=rng.randint(1, 24), temperature=rng.choice((0.0, 0.8)),
                            top_p=rng.choice((1.0, 0.9)), seed=rng.choice((None, index)))
    adapter = rng.choice((None, *adapters.values()))
    return GenerationRequest(f"soak-{index}", prompt, params, adapter)


def test_soak_random_traffic_with_cancellations(engine_factory, tiny_assets):
    steps = []
    engine = engine_factory(steps=steps, kv_cache_tokens=KV_TOKENS, max_num_seqs=16, max_batch_tokens=64,
                            adapter_slots=2, async_scheduling="always")  # the path with steps in flight
    rng = random.Random(1234)
    requests = [_random_request(rng, i, tiny_assets.adapters) for i in range(NUM_REQUESTS)]
    cancel_after = {r.request_id: rng.randint(0, 3) for r in requests if rng.random() < 0.25}

    async def one(request: GenerationRequest) -> list[RequestOutput]:
        await asyncio.sleep(rng.random() * 0.5)  # arrivals spread over time
        outputs = []
        async for output in engine.submit(request, asyncio.get_running_loop()):
            outputs.append(output)
            if len(outputs) > cancel_after.get(request.request_id, 1 << 30):
                engine.abort(request.request_id)  # the client went away; the engine still sends a final
        return outputs

    async def main():
        return await asyncio.wait_for(asyncio.gather(*(one(r) for r in requests)), timeout=300)

    results = asyncio.run(main())
    for request, outputs in zip(requests, results):
        finals = [o for o in outputs if o.finish_reason is not None]
        assert len(finals) == 1 and outputs[-1] is finals[0], request.request_id  # exactly one end, last
        tokens = [t for o in outputs for t in o.token_ids]
        assert len(tokens) == finals[0].completion_tokens <= request.params.max_tokens
        if request.request_id not in cancel_after and finals[0].finish_reason is FinishReason.LENGTH:
            assert len(tokens) == request.params.max_tokens
    # Every request ran in some step and no step ran a request twice.
    seen = {rid for step in steps for rid in step.request_ids}
    assert seen <= {r.request_id for r in requests}
    assert all(len(set(step.request_ids)) == len(step.request_ids) for step in steps)
    assert sum(step.num_preempted for step in steps) > 0, "the pool was meant to force preemption"
    stats = idle_stats(engine)
    assert stats.running_requests == stats.waiting_requests == 0
    assert stats.free_kv_tokens == KV_TOKENS
    assert stats.pinned_adapters == 0
