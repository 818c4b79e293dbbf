"""The engine on a CUDA device (run through the device tool: `pytest -m gpu tests/gpu`).

float32 on the GPU must give transformers + PEFT's greedy tokens on the same GPU, for mixed
adapter batches; bfloat16 (the serving default on CUDA) must run the same batches end to end.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from gpu_worker.intake import GenerationRequest
from gpu_worker.sequence import SamplingParams
from services.demo_assets import DEMO_BASE_MODEL
from tests.reference import ReferenceModels, assert_same_greedy
from tests.unit.gpu_worker.test_async_scheduling import assert_same_outputs, count_launched_ahead, mixed_requests, run_arriving
from tests.unit.gpu_worker.conftest import make_engine, run_all, tiny_assets, tokens_of  # noqa: F401 (fixture)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

MODELS = (None, "demo-r8", "demo-r16", "demo-r64")
PROMPTS = ("def", "import os\nimport sys\n", "class Handler(object):\n    def handle(self, request):\n")
MAX_NEW = 16


def _requests(assets) -> list[tuple[str | None, str, GenerationRequest]]:
    cases = [(m, PROMPTS[i % len(PROMPTS)]) for i, m in enumerate(MODELS * 2)]
    return [(m, p, GenerationRequest(f"r{i}", p, SamplingParams(max_tokens=MAX_NEW), assets.adapters[m] if m else None))
            for i, (m, p) in enumerate(cases)]


@pytest.fixture(scope="module")
def cuda_reference(tiny_assets):
    return ReferenceModels(DEMO_BASE_MODEL, tiny_assets.base_dir,
                           {n: r.storage_path for n, r in tiny_assets.adapters.items()}, device="cuda")


def _one_model_requests(assets, model: str | None, count: int) -> list[tuple[str | None, str, GenerationRequest]]:
    """`count` requests on one adapter: decode steps put them in one LoRA segment (grouped graphs)."""
    ref = assets.adapters[model] if model else None
    return [(model, PROMPTS[i % len(PROMPTS)],
             GenerationRequest(f"{model}-{i}", PROMPTS[i % len(PROMPTS)], SamplingParams(max_tokens=MAX_NEW), ref))
            for i in range(count)]


ENGINE_SETUPS = {
    "mixed": ({}, _requests),
    "one_adapter": ({}, lambda assets: _one_model_requests(assets, "demo-r16", 6)),
    # every slot's adapter on its own sequence: one-token LoRA segments
    "distinct": ({}, lambda assets: [c for c in _requests(assets)[:4]]),
    # a 96-token KV pool forces preemption; a 5-token budget forces chunked prefill
    "preempt_chunked": ({"kv_cache_tokens": 96, "max_batch_tokens": 5}, _requests),
    "eager": ({"cuda_graphs": False}, _requests),
}


@pytest.mark.parametrize("setup", sorted(ENGINE_SETUPS))
def test_float32_on_cuda_equals_peft_on_cuda(tiny_assets, cuda_reference, setup):
    fields, make_requests = ENGINE_SETUPS[setup]
    steps = []
    engine = make_engine(tiny_assets, steps, device="cuda", dtype="float32", **fields)
    try:
        cases = make_requests(tiny_assets)
        results = run_all(engine, [r for _, _, r in cases])
    finally:
        engine.stop()
    for (model, prompt, _), outputs in zip(cases, results):
        expected = cuda_reference.greedy_text(model or DEMO_BASE_MODEL, prompt, MAX_NEW)
        assert_same_greedy(f"{setup} {model}: {prompt!r}", expected, tokens_of(outputs))
    if setup == "preempt_chunked":
        assert sum(step.num_preempted for step in steps) > 0


def test_bfloat16_on_cuda_serves_mixed_batches(tiny_assets):
    steps = []
    engine = make_engine(tiny_assets, steps, device="cuda", dtype="auto")
    try:
        results = run_all(engine, [r for _, _, r in _requests(tiny_assets)])
    finally:
        engine.stop()
    assert all(len(tokens_of(outputs)) >= 1 for outputs in results)
    assert any(len(set(step.adapters)) == len(MODELS) for step in steps)


def test_async_scheduling_on_cuda_gives_what_one_step_at_a_time_gives(tiny_assets, monkeypatch):
    """Steps launched ahead take their in-flight input ids from the device (CUDA graphs, and eager
    steps that mix them with arrivals): greedy, seeded and logprob requests come out as from the
    synchronous engine."""
    ahead = count_launched_ahead(monkeypatch)
    requests = mixed_requests(tiny_assets.adapters)
    results = {}
    for mode in ("never", "cuda"):
        engine = make_engine(tiny_assets, device="cuda", dtype="float32", async_scheduling=mode, max_batch_tokens=48,
                             kv_cache_tokens=1024)  # a fixed pool: the engine before may not be collected yet
        try:
            results[mode] = run_arriving(engine, requests) if mode == "cuda" else run_all(engine, requests)
        finally:
            engine.stop()
    assert any(step.decodes_in_flight and step.prefill_tokens for step in ahead)
    assert any(step.decodes_in_flight and not step.prefill_tokens for step in ahead)
    for request, want, have in zip(requests, results["never"], results["cuda"]):
        assert_same_outputs(have, want, request.request_id)


def test_serving_compiles_no_kernel_after_the_engine_is_built(tiny_assets):
    """Building the engine (kernel warm-up, decode graph capture) leaves no Triton kernel to compile,
    or to load onto the GPU, while serving: a lone short prompt, a run on one adapter long enough to
    merge it, arrivals that meet steps in flight and unmerge it, and prompts long enough to be chunked
    and to widen block tables to 16 blocks. Each compile would stall every running request, and so
    would each first load on a fresh Triton cache (it builds the kernel's launcher); the stalls
    measured are in docs/benchmarks/engine.md."""
    from kernels.triton.compile_ahead import compiles_recorded

    steps = []
    engine = make_engine(tiny_assets, steps, device="cuda", dtype="auto", max_batch_tokens=192,
                         kv_cache_tokens=2048)  # a fixed pool: the engine before may not be collected yet
    one = tiny_assets.adapters["demo-r16"]
    long_prompt = "".join(f"def f{i}(x):\n    return x * {i}\n" for i in range(20))  # 245 of 256 tokens
    try:
        with compiles_recorded() as compiled:
            run_all(engine, [GenerationRequest("lone", "def", SamplingParams(max_tokens=4))])
            run_all(engine, [GenerationRequest(f"one-{i}", PROMPTS[i % len(PROMPTS)], SamplingParams(max_tokens=12),
                                               one) for i in range(4)])
            run_arriving(engine, mixed_requests(tiny_assets.adapters))
            run_all(engine, [GenerationRequest("long-base", long_prompt, SamplingParams(max_tokens=4)),
                             GenerationRequest("long-lora", long_prompt, SamplingParams(max_tokens=4), one),
                             GenerationRequest("short", "import os", SamplingParams(max_tokens=8), one)])
    finally:
        engine.stop()
    assert any(step.merged_adapter for step in steps)
    assert any(step.num_prefills and step.num_tokens == 192 for step in steps)  # a chunked prompt
    assert len(AutoTokenizer.from_pretrained(tiny_assets.base_dir)(long_prompt).input_ids) > 15 * 16  # 16 blocks
    assert compiled == []
