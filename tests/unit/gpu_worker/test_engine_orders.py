"""The registry's orders inside a running engine (tiny Llama, real PEFT adapters): a pin ordered to an
idle engine loads with no request and serves the next one as a hit; a retired adapter's stream in
flight runs to its end, then the adapter leaves every tier."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from gpu_worker.engine import Engine
from gpu_worker.intake import GenerationRequest
from gpu_worker.lora.adapter_stats import AdapterTierStats
from policy.placement_orders import PlacementOrders
from gpu_worker.sequence import FinishReason, SamplingParams
from policy.adapter_tiers import Tier

from .conftest import run_all, tokens_of

PROMPT = "def main():\n"


def _wait_for(engine: Engine, done: Callable[[AdapterTierStats], bool], timeout_s: float = 10.0) -> AdapterTierStats:
    deadline = time.monotonic() + timeout_s
    while not done(stats := engine.stats().adapters):
        assert time.monotonic() < deadline, f"timed out; adapters: {stats}"
        time.sleep(0.01)
    return stats


def test_a_pin_ordered_to_an_idle_engine_loads_without_a_request(engine_factory, tiny_assets):
    engine = engine_factory(adapter_slots=2)
    r16 = tiny_assets.adapters["demo-r16"]
    engine.apply_orders(PlacementOrders(pins=(r16,)))
    stats = _wait_for(engine, lambda s: s.gpu_adapters == ("demo-r16",))
    assert [(p.name, p.tier, p.loading, p.pinned) for p in stats.placements] == [("demo-r16", Tier.GPU, False, True)]
    assert (stats.hits, stats.misses) == (0, 0)
    run_all(engine, [GenerationRequest("r", PROMPT, SamplingParams(max_tokens=2), r16)])
    assert engine.stats().adapters.hits == 1      # usable when the request came
    engine.apply_orders(PlacementOrders())         # the order was lifted
    stats = _wait_for(engine, lambda s: not s.placements[0].pinned)
    assert stats.gpu_adapters == ("demo-r16",)     # unpinned stays where it is, evictable


def test_a_retired_adapter_finishes_its_stream_then_leaves_every_tier(engine_factory, tiny_assets):
    engine = engine_factory(adapter_slots=2)
    r8 = tiny_assets.adapters["demo-r8"]
    alone = tokens_of(run_all(engine, [GenerationRequest("before", PROMPT, SamplingParams(max_tokens=40), r8)])[0])

    async def stream_across_the_retirement() -> tuple[list[int], FinishReason | None]:
        handle = engine.submit(GenerationRequest("long", PROMPT, SamplingParams(max_tokens=40), r8),
                               asyncio.get_running_loop())
        tokens, finish = [], None
        async for output in handle:
            if not tokens:                          # streaming: the registry says the adapter is deleted
                engine.apply_orders(PlacementOrders(retire=(("demo-r8", r8.sha256),)))
            tokens += output.token_ids
            finish = output.finish_reason
        return tokens, finish

    tokens, finish = asyncio.run(stream_across_the_retirement())
    assert finish is FinishReason.LENGTH and tokens == alone  # the stream in flight ran to its end
    stats = _wait_for(engine, lambda s: s.gpu_versions == 0)
    assert (stats.placements, stats.host_versions, stats.gpu_adapters, stats.host_adapters) == ((), 0, (), ())
