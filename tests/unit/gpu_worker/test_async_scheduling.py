"""Async scheduling: a step is launched before the previous step's tokens reach the host (they feed
it on the device), whatever else it holds: arrivals, prefill chunks, requests about to finish. It
must change nothing a client sees: the same tokens, stops, log-probabilities and finals as one step
at a time, and every block back at the end."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest
import torch

from gpu_worker.builder import async_scheduling_on, build_engine
from gpu_worker.intake import GenerationRequest
from gpu_worker.model_runner import ModelRunner
from gpu_worker.sequence import FinishReason, SamplingParams
from services.common.config import ConfigError, WorkerConfig
from services.common.errors import Internal

from .conftest import collect, idle_stats, run_all, tokens_of

KV_TOKENS = 256
PROMPTS = ("def main():\n", "import os\nx = 1", "class A:\n    def f(self):", "return (x)", "1 = x")


def mixed_requests(adapters) -> list[GenerationRequest]:
    """Greedy, seeded and logprob requests over the base model and every adapter, of 1-20 tokens."""
    names = (None, *adapters.values())
    requests = []
    for i in range(15):
        params = dict(max_tokens=(1, 2, 7, 12, 20)[i % 5])
        if i % 3 == 1:
            params.update(temperature=0.9, top_p=0.9, seed=i)
        if i % 4 == 2:
            params.update(logprobs=3)
        requests.append(GenerationRequest(f"r{i}", PROMPTS[i % len(PROMPTS)], SamplingParams(**params),
                                          names[i % len(names)]))
    return requests


@dataclass(frozen=True)
class LaunchedAhead:
    """A step launched while the one before was in flight."""
    decodes_in_flight: int   # sequences whose input token was still on the device
    prefill_tokens: int      # prompt tokens in the same step (arrivals, chunks)


def count_launched_ahead(monkeypatch) -> list[LaunchedAhead]:
    """Records every step the model runner ran with the step before still in flight."""
    launched: list[LaunchedAhead] = []
    run = ModelRunner.run

    def recorded(self, items, plan, previous=None, copies=()):
        if previous is not None:
            launched.append(LaunchedAhead(sum(1 for item in items if item.seq.num_in_flight),
                                          sum(item.num_new for item in items if item.num_new > 1)))
        return run(self, items, plan, previous, copies)
    monkeypatch.setattr(ModelRunner, "run", recorded)
    return launched


def assert_same_outputs(have, want, request_id: str) -> None:
    """Same deltas, texts and finals; log-probabilities to float tolerance, since the two engines
    batch the requests differently (float sums in another order)."""
    assert [(o.token_ids, o.text, o.finish_reason) for o in have] == \
        [(o.token_ids, o.text, o.finish_reason) for o in want], request_id
    for a, b in zip(have, want):
        assert len(a.logprobs) == len(b.logprobs), request_id
        for x, y in zip(a.logprobs, b.logprobs):
            assert [t for t, _ in x.top] == [t for t, _ in y.top], request_id
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4), request_id
            assert [v for _, v in x.top] == pytest.approx([v for _, v in y.top], abs=1e-4), request_id


def run_arriving(engine, requests: list[GenerationRequest], gap_s: float = 0.004) -> list[list]:
    """Submit request i after i * gap_s seconds (so arrivals meet steps in flight); collect each one's outputs."""
    async def one(i: int, request: GenerationRequest):
        await asyncio.sleep(i * gap_s)
        return await collect(engine, request)

    async def main():
        return await asyncio.wait_for(asyncio.gather(*(one(i, r) for i, r in enumerate(requests))), timeout=120)
    return asyncio.run(main())


def test_async_steps_give_what_one_step_at_a_time_gives(engine_factory, tiny_assets, monkeypatch):
    ahead = count_launched_ahead(monkeypatch)
    sync = engine_factory(async_scheduling="never", kv_cache_tokens=KV_TOKENS, max_batch_tokens=48)
    (free,) = run_all(sync, [GenerationRequest("free", PROMPTS[0], SamplingParams(max_tokens=20))])
    stop_text = free[-1].full_text[6:9]
    # Two that stop inside the free-running output: on a stop string, and on its fourth token's id.
    requests = mixed_requests(tiny_assets.adapters) + [
        GenerationRequest("stop-text", PROMPTS[0], SamplingParams(max_tokens=20, stop=(stop_text,))),
        GenerationRequest("stop-id", PROMPTS[0], SamplingParams(max_tokens=20, stop_token_ids=(tokens_of(free)[3],)))]
    expected = run_all(sync, requests)
    assert not ahead, "the synchronous engine never launches a step ahead"

    engine = engine_factory(async_scheduling="always", kv_cache_tokens=KV_TOKENS, max_batch_tokens=48)
    got = run_arriving(engine, requests)
    assert any(step.decodes_in_flight for step in ahead), "decodes were meant to read their ids on the device"
    assert any(step.decodes_in_flight and step.prefill_tokens for step in ahead), \
        "arrivals and chunks were meant to join steps launched ahead"
    for request, want, have in zip(requests, expected, got):
        assert_same_outputs(have, want, request.request_id)
    assert any(o.logprobs for outputs in got for o in outputs)
    assert got[-2][-1].finish_reason is FinishReason.STOP and got[-2][-1].full_text == free[-1].full_text[:6]
    stop_id = tokens_of(free)[3]
    assert got[-1][-1].finish_reason is FinishReason.STOP
    assert tokens_of(got[-1]) == tokens_of(free)[:tokens_of(free).index(stop_id) + 1]
    stats = idle_stats(engine)
    assert stats.running_requests == 0 and stats.free_kv_tokens == KV_TOKENS and stats.pinned_adapters == 0


def test_preemption_under_async_scheduling_still_matches(engine_factory, tiny_assets, monkeypatch):
    ahead = count_launched_ahead(monkeypatch)
    requests = [GenerationRequest(f"p{i}", PROMPTS[i % len(PROMPTS)] * 3, SamplingParams(max_tokens=24),
                                  (None, *tiny_assets.adapters.values())[i % 3]) for i in range(6)]
    steps_sync, steps_async = [], []
    expected = run_all(engine_factory(steps_sync, async_scheduling="never", kv_cache_tokens=128, kv_block_size=16),
                       requests)
    engine = engine_factory(steps_async, async_scheduling="always", kv_cache_tokens=128, kv_block_size=16)
    got = run_all(engine, requests)
    assert sum(s.num_preempted for s in steps_async) > 0, "the pool was meant to force preemption"
    assert any(step.decodes_in_flight for step in ahead)
    assert [tokens_of(o) for o in got] == [tokens_of(o) for o in expected]
    assert idle_stats(engine).free_kv_tokens == 128


def test_abort_while_a_step_is_in_flight_frees_everything(engine_factory):
    engine = engine_factory(async_scheduling="always", kv_cache_tokens=KV_TOKENS)

    async def main():
        loop = asyncio.get_running_loop()
        victim = engine.submit(GenerationRequest("victim", PROMPTS[1], SamplingParams(max_tokens=200)), loop)
        other = asyncio.ensure_future(collect(engine, GenerationRequest("other", PROMPTS[2],
                                                                        SamplingParams(max_tokens=30))))
        seen = 0
        async for _ in victim:
            seen += 1
            if seen == 3:
                engine.abort("victim")
        return seen, await asyncio.wait_for(other, timeout=30)

    seen, other = asyncio.run(main())
    assert seen < 200
    assert other[-1].finish_reason is FinishReason.LENGTH and len(tokens_of(other)) == 30
    stats = idle_stats(engine)
    assert stats.running_requests == 0 and stats.free_kv_tokens == KV_TOKENS


def test_a_failed_step_fails_the_running_requests_and_frees_their_blocks(engine_factory, monkeypatch):
    """The fault hits a step launched ahead while a request that already ended (its final sent)
    is still held by the step in flight: the others fail, that one keeps its final, nothing leaks."""
    engine = engine_factory(async_scheduling="always", kv_cache_tokens=KV_TOKENS)
    (free,) = run_all(engine, [GenerationRequest("free", PROMPTS[0], SamplingParams(max_tokens=8))])
    stop_id = tokens_of(free)[1]
    runner, scheduler = engine._runner, engine._scheduler
    run, faults = runner.run, []

    def failing(items, plan, previous=None, copies=()):
        ended_in_flight = [s for s in scheduler.running if s.finish_reason is not None and s.num_in_flight]
        if previous is not None and ended_in_flight and not faults:
            faults.append(ended_in_flight[0].request_id)
            raise RuntimeError("injected device fault")
        return run(items, plan, previous, copies)
    monkeypatch.setattr(runner, "run", failing)

    async def one(request):
        try:
            return await collect(engine, request)
        except Internal as error:
            return error

    async def main():
        return await asyncio.wait_for(asyncio.gather(
            one(GenerationRequest("stopper", PROMPTS[0], SamplingParams(max_tokens=40, stop_token_ids=(stop_id,)))),
            *(one(GenerationRequest(f"long{i}", PROMPTS[i], SamplingParams(max_tokens=40))) for i in (1, 2))),
            timeout=60)  # a dead engine thread would leave them waiting

    stopper, *long = asyncio.run(main())
    assert faults == ["stopper"], "the fault was meant to hit while the stopped request was in flight"
    assert stopper[-1].finish_reason is FinishReason.STOP
    assert tokens_of(stopper) == tokens_of(free)[:tokens_of(free).index(stop_id) + 1]
    assert all(isinstance(result, Internal) for result in long)
    stats = idle_stats(engine)
    assert stats.running_requests == 0 and stats.free_kv_tokens == KV_TOKENS and stats.pinned_adapters == 0
    (after,) = run_all(engine, [GenerationRequest("after", PROMPTS[0], SamplingParams(max_tokens=4))])
    assert len(tokens_of(after)) == 4  # the engine serves on


@pytest.mark.parametrize(("setting", "device", "expected"), [
    ("cuda", "cuda", True), ("cuda", "cpu", False), ("always", "cpu", True), ("never", "cuda", False)])
def test_the_setting_keeps_async_scheduling_to_devices_apart_from_the_host(setting, device, expected):
    assert async_scheduling_on(setting, torch.device(device)) is expected


def test_a_bad_setting_fails_before_the_model_loads(tiny_assets, tmp_path):
    with pytest.raises(ConfigError, match="worker.async_scheduling: expected one of cuda, always, never, got 'on'"):
        build_engine(tmp_path / "no-model-here", WorkerConfig(base_model=tiny_assets.name, async_scheduling="on", cpu_lora_workers=0),
                     tiny_assets.store)
