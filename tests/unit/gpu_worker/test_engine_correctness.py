"""Greedy tokens from our engine equal transformers + PEFT, alone and batched across adapters."""

from __future__ import annotations

import pytest

from gpu_worker.intake import GenerationRequest
from gpu_worker.sequence import SamplingParams
from services.demo_assets import DEMO_BASE_MODEL
from tests.reference import ReferenceModels, assert_same_greedy

from .conftest import idle_stats, run_all, tokens_of

MAX_NEW = 12
PROMPTS = (
    "def",
    "import os\nimport sys\n",
    "class Handler(object):\n    \"\"\"Handle a request and return its response to the caller.\"\"\"\n    def handle(self, request):\n",
)
ADAPTERS = (None, "demo-r8", "demo-r16", "demo-r64")


@pytest.fixture(scope="module")
def reference(tiny_assets):
    """(adapter, prompt) -> transformers + PEFT greedy tokens and per-step log-probabilities."""
    models = ReferenceModels(DEMO_BASE_MODEL, tiny_assets.base_dir,
                             {name: ref.storage_path for name, ref in tiny_assets.adapters.items()})
    return {(adapter, prompt): models.greedy_text(adapter or DEMO_BASE_MODEL, prompt, MAX_NEW)
            for adapter in ADAPTERS for prompt in PROMPTS}


def _request(adapter: str | None, prompt: str, tiny_assets, index: int) -> GenerationRequest:
    ref = tiny_assets.adapters[adapter] if adapter else None
    return GenerationRequest(f"r{index}-{adapter}", prompt, SamplingParams(max_tokens=MAX_NEW), ref)


def test_adapters_change_the_reference_output(reference):
    """Guards the test's power: every adapter's greedy tokens differ from the base model's."""
    for prompt in PROMPTS:
        base = reference[(None, prompt)].tokens
        for adapter in ADAPTERS[1:]:
            assert reference[(adapter, prompt)].tokens != base, (adapter, prompt)


def test_one_at_a_time_matches_transformers_and_peft(engine_factory, tiny_assets, reference):
    engine = engine_factory(adapter_slots=2)  # fewer slots than adapters: eviction happens too
    for i, adapter in enumerate(ADAPTERS):
        for j, prompt in enumerate(PROMPTS):
            (outputs,) = run_all(engine, [_request(adapter, prompt, tiny_assets, 10 * i + j)])
            assert_same_greedy(f"{adapter}: {prompt!r}", reference[(adapter, prompt)], tokens_of(outputs))


def test_concurrent_mixed_adapters_share_batches_and_match(engine_factory, tiny_assets, reference):
    steps = []
    # A small token budget admits the long prompts over several steps, next to running decodes.
    engine = engine_factory(steps=steps, max_batch_tokens=64)
    cases = [(adapter, PROMPTS[i % len(PROMPTS)]) for i, adapter in enumerate(ADAPTERS * 2)]
    requests = [_request(a, p, tiny_assets, i) for i, (a, p) in enumerate(cases)]
    results = run_all(engine, requests)
    for (adapter, prompt), outputs in zip(cases, results):
        assert_same_greedy(f"{adapter}: {prompt!r}", reference[(adapter, prompt)], tokens_of(outputs))
    # They really ran together: one forward pass held every adapter and the base model at once,
    # and prefills were packed with decodes of other requests.
    assert any(set(step.adapters) == set(ADAPTERS) for step in steps), steps[:3]
    assert max(len(step.request_ids) for step in steps) == len(requests)
    assert any(0 < step.num_prefills < len(step.request_ids) for step in steps), steps[:3]


def test_tiny_kv_pool_preempts_and_still_matches(engine_factory, tiny_assets, reference):
    """A KV pool of 8 blocks (128 tokens) cannot hold the batch: sequences are preempted, recomputed
    later, and still produce exactly the reference tokens."""
    steps = []
    engine = engine_factory(steps=steps, kv_cache_tokens=128, kv_block_size=16)
    cases = [(adapter, prompt) for prompt in PROMPTS for adapter in ADAPTERS]
    requests = [_request(a, p, tiny_assets, 100 + i) for i, (a, p) in enumerate(cases)]
    results = run_all(engine, requests)
    for (adapter, prompt), outputs in zip(cases, results):
        assert_same_greedy(f"{adapter}: {prompt!r}", reference[(adapter, prompt)], tokens_of(outputs))
    assert sum(step.num_preempted for step in steps) > 0
    assert idle_stats(engine).free_kv_tokens == 128


def test_chunked_prefill_keeps_decodes_running_and_matches(engine_factory, tiny_assets, reference):
    """A 6-token budget splits every longer prompt into chunks; decodes of other requests keep
    running in the same steps, and the output is unchanged."""
    steps = []
    engine = engine_factory(steps=steps, max_batch_tokens=6)
    long_prompt = PROMPTS[2]
    cases = [("demo-r16", PROMPTS[0]), (None, long_prompt), ("demo-r64", long_prompt), ("demo-r8", PROMPTS[1])]
    requests = [_request(a, p, tiny_assets, 200 + i) for i, (a, p) in enumerate(cases)]
    results = run_all(engine, requests)
    for (adapter, prompt), outputs in zip(cases, results):
        assert_same_greedy(f"{adapter}: {prompt!r}", reference[(adapter, prompt)], tokens_of(outputs))
    assert all(step.num_tokens <= 6 for step in steps)
    # Some step ran a prompt chunk next to another request's decode.
    assert any(step.num_prefills and step.num_prefills < len(step.request_ids) for step in steps)
