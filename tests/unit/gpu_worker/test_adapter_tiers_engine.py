"""The adapter tiers inside a running engine (tiny Llama, real PEFT adapters): greedy outputs equal
transformers + PEFT whichever tier an adapter comes from and across a version change; a slow disk
delays only the request that waits for it; an engine with nothing else to do sleeps until the load
completes; the metrics and the pushed state tell the tiers apart."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from safetensors.torch import load_file

from gpu_worker.intake import GenerationRequest
from gpu_worker.lora import loader
from gpu_worker.lora.loader import AdapterRef
from gpu_worker.metrics import AdapterTierMetrics
from gpu_worker.scheduler import Scheduler
from gpu_worker.sequence import SamplingParams
from gpu_worker.state_push import StateSource
from services.common.adapter_layout import WEIGHTS_FILE, directory_digest
from policy.perf_model import PerfModel, perf_model_path
from services.demo_assets import DEMO_BASE_MODEL, DemoAdapterSpec, build_lora_adapter
from tests.reference import ReferenceModels, assert_same_greedy

from .conftest import idle_stats, run_all, tokens_of

MAX_NEW = 10
PROMPT = "import os\nimport sys\n"
V2 = "demo-r8@v2"  # the reference's name for demo-r8's second version


@pytest.fixture(scope="module")
def demo_r8_v2(tiny_assets) -> AdapterRef:
    """demo-r8 registered again with other weights: the same name, another digest."""
    spec = DemoAdapterSpec("demo-r8", 8, 16.0, ("q_proj", "v_proj"), seed=101)
    directory = build_lora_adapter(tiny_assets.base_dir, tiny_assets.store / "demo-r8-v2", spec)
    v1 = tiny_assets.adapters["demo-r8"]
    return dataclasses.replace(v1, sha256=directory_digest(directory), storage_path=str(directory))


@pytest.fixture(scope="module")
def reference(tiny_assets, demo_r8_v2) -> ReferenceModels:
    dirs = {name: ref.storage_path for name, ref in tiny_assets.adapters.items()}
    return ReferenceModels(DEMO_BASE_MODEL, tiny_assets.base_dir, {**dirs, V2: demo_r8_v2.storage_path})


def _request(tag: str, adapter: AdapterRef, max_tokens: int = MAX_NEW) -> GenerationRequest:
    return GenerationRequest(tag, PROMPT, SamplingParams(max_tokens=max_tokens), adapter)


def _packed_bytes(engine_factory, tiny_assets) -> dict[str, int]:
    """GPU bytes each demo adapter occupies, loaded alone into a roomy engine."""
    sizes = {}
    for name in ("demo-r8", "demo-r16", "demo-r64"):
        engine = engine_factory(adapter_slots=4)
        run_all(engine, [_request(name, tiny_assets.adapters[name], max_tokens=1)])
        deadline = time.monotonic() + 10
        while not engine.stats().adapters.gpu_versions and time.monotonic() < deadline:
            time.sleep(0.01)  # stats are published after a step's outputs are delivered
        sizes[name] = engine.stats().adapters.gpu_bytes
    return sizes


def test_gpu_memory_is_packed_by_true_size(engine_factory, tiny_assets):
    """Each adapter occupies its own A and B bytes (in the engine's float32), up to the alignment of its
    blocks: not a slot padded to the largest rank."""
    sizes = _packed_bytes(engine_factory, tiny_assets)
    for name, occupied in sizes.items():
        tensors = load_file(Path(tiny_assets.adapters[name].storage_path) / WEIGHTS_FILE)
        true_bytes = sum(t.numel() for t in tensors.values()) * 4
        assert true_bytes <= occupied <= 1.1 * true_bytes, (name, occupied, true_bytes)


def test_outputs_equal_peft_from_disk_resident_from_host_and_after_eviction(engine_factory, tiny_assets, reference):
    # GPU memory for demo-r64 alone, or for demo-r8 and demo-r16 together; host memory for all three.
    sizes = _packed_bytes(engine_factory, tiny_assets)
    engine = engine_factory(adapter_gpu_bytes=sizes["demo-r64"], adapter_host_bytes=8 * sum(sizes.values()))
    # (adapter, where it is when its request arrives)
    path = [("demo-r8", "disk"), ("demo-r8", "gpu"),
            ("demo-r16", "disk"),   # beside demo-r8: packed, nothing evicted
            ("demo-r64", "disk"),   # takes the whole GPU budget: both others leave it, keeping host copies
            ("demo-r8", "host"),    # demo-r64 leaves the GPU
            ("demo-r16", "host")]   # fits beside demo-r8 again
    for i, (name, source) in enumerate(path):
        before = engine.stats().adapters
        (outputs,) = run_all(engine, [_request(f"r{i}", tiny_assets.adapters[name])])
        assert_same_greedy(f"{name} from {source}", reference.greedy_text(name, PROMPT, MAX_NEW), tokens_of(outputs))
        after = idle_stats(engine).adapters
        loads = {t.source: t.count - b.count for t, b in zip(after.loads, before.loads)}
        assert loads == {"gpu": {"disk": 0, "host": 0}, "host": {"disk": 0, "host": 1},
                         "disk": {"disk": 1, "host": 1}}[source], (i, name, source)
        assert after.hits - before.hits == (source == "gpu")
        # What a miss sent here would evict, for the gateway: demo-r64 while it fills the GPU budget.
        assert (after.gpu_victim_rate > 0) == (name == "demo-r64"), (i, name, after.gpu_victim_rate)
    stats = idle_stats(engine).adapters
    assert (stats.gpu_adapters, stats.host_adapters) == (("demo-r16", "demo-r8"), ("demo-r16", "demo-r64", "demo-r8"))
    assert (stats.gpu_evictions, stats.host_evictions, stats.load_failures) == (3, 0, 0)
    assert stats.gpu_bytes == sizes["demo-r8"] + sizes["demo-r16"]

    pushed = StateSource(engine, PerfModel.load(perf_model_path("cpu-tessera-demo-llama")), max_batch=32).snapshot()
    assert (list(pushed.gpu_adapters), list(pushed.host_adapters)) == (
        ["demo-r16", "demo-r8"], ["demo-r16", "demo-r64", "demo-r8"])
    assert pushed.gpu_victim_rate == 0.0  # room for another demo-r16 beside them: a miss evicts nothing
    metrics = CollectorRegistry()
    metrics.register(AdapterTierMetrics(engine))
    text = generate_latest(metrics).decode()
    for line in ('tessera_worker_adapters{tier="host"} 3.0', 'tessera_worker_adapter_evictions_total{tier="gpu"} 3.0',
                 'tessera_worker_adapter_load_seconds_count{source="disk"} 3.0',
                 'tessera_worker_adapter_load_seconds_count{source="host"} 5.0',
                 "tessera_worker_adapter_hits_total 1.0", "tessera_worker_adapter_misses_total 5.0",
                 f"tessera_worker_adapter_gpu_compactions_total {float(stats.gpu_compactions)}"):
        assert line in text, line


@pytest.mark.parametrize("slots", [2, 1], ids=["two-slots", "one-slot-merged"])
def test_a_new_version_serves_new_requests_while_in_flight_ones_finish_on_the_old_weights(
        engine_factory, tiny_assets, demo_r8_v2, reference, slots):
    """The in-flight request ran merged on v1 for a while; with one slot v2 takes v1's slot after it,
    and must not find v1 still folded into the base weights. Same prompt: the prefix cache must not
    hand v2 the K/V that v1 computed."""
    engine = engine_factory(adapter_slots=slots)
    v1 = tiny_assets.adapters["demo-r8"]

    async def main() -> tuple[list[int], list[int]]:
        loop = asyncio.get_running_loop()
        old = aiter(engine.submit(_request("old", v1, max_tokens=4 * MAX_NEW), loop))
        first = await anext(old)  # running: v1 is pinned, its prefix blocks are published
        new = engine.submit(_request("new", demo_r8_v2), loop)
        old_tokens = first.token_ids + [t async for out in old for t in out.token_ids]
        return old_tokens, [t async for out in new for t in out.token_ids]

    old_tokens, new_tokens = asyncio.run(main())
    assert_same_greedy("in flight on v1", reference.greedy_text("demo-r8", PROMPT, 4 * MAX_NEW), old_tokens)
    assert_same_greedy("new on v2", reference.greedy_text(V2, PROMPT, MAX_NEW), new_tokens)
    assert reference.greedy_text(V2, PROMPT, MAX_NEW).tokens != reference.greedy_text("demo-r8", PROMPT, MAX_NEW).tokens
    stats = idle_stats(engine)
    # v1 left every tier after its last request: only v2 is held, under the name.
    assert (stats.adapters.gpu_versions, stats.adapters.host_versions, stats.resident_adapters) == (1, 1, ("demo-r8",))
    (again,) = run_all(engine, [_request("again", demo_r8_v2)])
    assert tokens_of(again) == new_tokens


def _slow_reads(monkeypatch, slow: AdapterRef, delay_s: float) -> None:
    """Reading `slow`'s files takes `delay_s` longer (a slow disk), on whatever thread reads them."""
    read = loader._verified_files

    def slow_read(ref, directory):
        if ref.sha256 == slow.sha256:
            time.sleep(delay_s)
        return read(ref, directory)
    monkeypatch.setattr(loader, "_verified_files", slow_read)


def test_a_slow_disk_delays_only_the_request_that_waits_for_it(engine_factory, tiny_assets, reference, monkeypatch):
    delay_s, long_new = 1.0, 200
    engine = engine_factory()
    fast, slow = tiny_assets.adapters["demo-r8"], tiny_assets.adapters["demo-r16"]
    prompts = ("def", "class Handler(object):\n", "for i in range(10):", "SELECT name FROM users WHERE")
    alone = [tokens_of(o) for o in run_all(engine, [GenerationRequest(f"warm-{i}", p, SamplingParams(
        max_tokens=long_new), fast) for i, p in enumerate(prompts)])]
    assert all(len(tokens) == long_new for tokens in alone)  # no early EOS: each stream runs all along
    _slow_reads(monkeypatch, slow, delay_s)

    async def main() -> tuple[list[list[float]], float, float, list[int]]:
        loop = asyncio.get_running_loop()
        arrivals: list[list[float]] = [[] for _ in prompts]

        async def stream(i: int, prompt: str) -> None:
            request = GenerationRequest(f"run-{i}", prompt, SamplingParams(max_tokens=long_new), fast)
            async for output in engine.submit(request, loop):
                arrivals[i] += [time.monotonic()] * len(output.token_ids)

        running = [asyncio.create_task(stream(i, p)) for i, p in enumerate(prompts)]
        while not all(arrivals):
            await asyncio.sleep(0.001)
        submitted = time.monotonic()
        delayed = [out async for out in engine.submit(_request("slow", slow), loop)]
        done = time.monotonic()
        await asyncio.gather(*running)
        return arrivals, submitted, done, tokens_of(delayed)

    arrivals, submitted, done, delayed_tokens = asyncio.run(main())
    assert done - submitted >= delay_s  # the delay was real: the slow request waited for its read
    assert_same_greedy("the delayed request", reference.greedy_text("demo-r16", PROMPT, MAX_NEW), delayed_tokens)
    for times in arrivals:
        during = [t for t in times if submitted <= t <= submitted + delay_s]
        gaps = [b - a for a, b in itertools.pairwise(during)]
        # The others kept streaming through the read: many tokens, no gap anywhere near the delay.
        assert len(during) >= 10 and max(gaps) < delay_s / 2, (len(during), max(gaps, default=None))


def test_an_engine_waiting_only_for_a_load_sleeps_until_it_completes(engine_factory, tiny_assets, reference,
                                                                      monkeypatch):
    delay_s = 0.5
    adapter = tiny_assets.adapters["demo-r64"]
    _slow_reads(monkeypatch, adapter, delay_s)
    passes = []
    schedule = Scheduler.schedule
    monkeypatch.setattr(Scheduler, "schedule",
                        lambda self, may_run=None: passes.append(time.monotonic()) or schedule(self, may_run))
    engine = engine_factory()
    started = time.monotonic()
    (outputs,) = run_all(engine, [_request("cold", adapter)])
    elapsed = time.monotonic() - started
    assert_same_greedy("after the wait", reference.greedy_text("demo-r64", PROMPT, MAX_NEW), tokens_of(outputs))
    waiting = [t for t in passes if t < started + delay_s]
    assert len(waiting) <= 5, len(waiting)  # a pass at arrival and at a wake, not one every millisecond
    assert elapsed < delay_s + 1.0  # woken by the load, not by a timeout
