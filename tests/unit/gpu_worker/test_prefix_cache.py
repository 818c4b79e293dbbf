"""KV prefix caching: a request whose leading full blocks (tokens and adapter) an earlier request
computed prefills only the rest; its greedy tokens equal a cold run's and transformers + PEFT's.
The same prefix under another adapter shares nothing. Under a tiny KV pool with preemption every
block comes back."""

from __future__ import annotations

import dataclasses

import pytest
from transformers import AutoTokenizer

from gpu_worker.block_hashes import block_hash
from gpu_worker.block_manager import BlockManager
from gpu_worker.engine import StepRecord
from gpu_worker.intake import GenerationRequest
from gpu_worker.lora.loader import AdapterRef
from gpu_worker.sequence import SamplingParams, Sequence
from services.demo_assets import DEMO_BASE_MODEL
from tests.reference import ReferenceModels, assert_same_greedy

from .conftest import idle_stats, run_all, tokens_of

MAX_NEW = 8
BLOCK = 16
PREFIX = ("You are a careful reviewer of Python code. Read the function below, then answer the question "
          "that follows it in one short sentence.\n\ndef handle(self, request):\n    return self.route(request)\n")
PROMPTS = (PREFIX + "Q: what does it return?", PREFIX + "Q: is it recursive?")


@pytest.fixture(scope="module")
def reference(tiny_assets):
    models = ReferenceModels(DEMO_BASE_MODEL, tiny_assets.base_dir,
                             {name: ref.storage_path for name, ref in tiny_assets.adapters.items()})
    return {(adapter, prompt): models.greedy_text(adapter or DEMO_BASE_MODEL, prompt, MAX_NEW)
            for adapter in (None, "demo-r8", "demo-r16") for prompt in PROMPTS}


@pytest.fixture(scope="module")
def prompt_lens(tiny_assets) -> dict[str, int]:
    tokenizer = AutoTokenizer.from_pretrained(tiny_assets.base_dir)
    return {prompt: len(tokenizer(prompt).input_ids) for prompt in PROMPTS + (PREFIX,)}


def _request(tiny_assets, tag: str, adapter: str | None, prompt: str) -> GenerationRequest:
    return GenerationRequest(tag, prompt, SamplingParams(max_tokens=MAX_NEW),
                             tiny_assets.adapters[adapter] if adapter else None)


def _one_by_one(engine, steps: list[StepRecord], requests: list[GenerationRequest]) -> list[tuple[list[int], int]]:
    """Each request alone: (its tokens, the tokens its prefill computed)."""
    results = []
    for request in requests:
        (outputs,) = run_all(engine, [request])
        prefill = next(step for step in steps if request.request_id in step.request_ids)
        results.append((tokens_of(outputs), prefill.num_tokens))
    return results


def test_shared_prefix_prefills_only_the_suffix(engine_factory, tiny_assets, reference, prompt_lens):
    assert prompt_lens[PREFIX] >= 3 * BLOCK  # several whole blocks to share
    cases = [("demo-r8", PROMPTS[0]), ("demo-r8", PROMPTS[1]), ("demo-r8", PROMPTS[0])]
    steps: list[StepRecord] = []
    engine = engine_factory(steps=steps, kv_block_size=BLOCK)
    warm = _one_by_one(engine, steps, [_request(tiny_assets, f"warm-{i}", *case) for i, case in enumerate(cases)])
    cold_steps: list[StepRecord] = []
    cold_engine = engine_factory(steps=cold_steps, kv_block_size=BLOCK, enable_prefix_caching=False)
    cold = _one_by_one(cold_engine, cold_steps, [_request(tiny_assets, f"cold-{i}", *c) for i, c in enumerate(cases)])

    shared = prompt_lens[PREFIX] // BLOCK * BLOCK  # the prefix's whole blocks (its last partial one differs)
    again = (prompt_lens[PROMPTS[0]] - 1) // BLOCK * BLOCK  # all but the last token, in whole blocks
    assert [computed for _, computed in warm] == [prompt_lens[PROMPTS[0]], prompt_lens[PROMPTS[1]] - shared,
                                                  prompt_lens[PROMPTS[0]] - again]
    assert [computed for _, computed in cold] == [prompt_lens[prompt] for _, prompt in cases]
    assert idle_stats(engine).prefix_cache_hit_tokens_total == shared + again
    for (adapter, prompt), (tokens, _), (cold_tokens, _) in zip(cases, warm, cold):
        assert tokens == cold_tokens
        assert_same_greedy(f"{adapter}: {prompt!r}", reference[(adapter, prompt)], tokens)


def test_same_prefix_under_another_adapter_shares_nothing(engine_factory, tiny_assets, reference):
    """LoRA on k/v changes the cache: the prefix key includes the adapter (and the base model is one too)."""
    cases = [("demo-r8", PROMPTS[0]), ("demo-r16", PROMPTS[0]), (None, PROMPTS[0]), ("demo-r16", PROMPTS[1])]
    steps: list[StepRecord] = []
    engine = engine_factory(steps=steps, kv_block_size=BLOCK)
    results = _one_by_one(engine, steps, [_request(tiny_assets, f"r{i}", *case) for i, case in enumerate(cases)])
    # Only the last request (demo-r16 again) finds blocks: those demo-r16 computed before it.
    assert idle_stats(engine).prefix_cache_hit_tokens_total > 0
    first_three = [computed for _, computed in results[:3]]
    assert first_three[0] == first_three[1] == first_three[2]
    for (adapter, prompt), (tokens, _) in zip(cases, results):
        assert_same_greedy(f"{adapter}: {prompt!r}", reference[(adapter, prompt)], tokens)


def test_tiny_pool_with_preemption_shares_evicts_and_frees_everything(engine_factory, tiny_assets, reference):
    """Sixteen 8-token blocks cannot hold six requests sharing prefixes, admitted chunk by chunk:
    they preempt and reuse blocks, still match the reference, and every block is free again
    at the end."""
    steps: list[StepRecord] = []
    engine = engine_factory(steps=steps, kv_cache_tokens=128, kv_block_size=8, max_batch_tokens=24)
    cases = [(adapter, prompt) for prompt in PROMPTS for adapter in (None, "demo-r8", "demo-r16")]
    results = run_all(engine, [_request(tiny_assets, f"t{i}", *case) for i, case in enumerate(cases)])
    for (adapter, prompt), outputs in zip(cases, results):
        assert_same_greedy(f"{adapter}: {prompt!r}", reference[(adapter, prompt)], tokens_of(outputs))
    stats = idle_stats(engine)
    assert sum(step.num_preempted for step in steps) > 0
    assert stats.prefix_cache_hit_tokens_total > 0
    assert stats.free_kv_tokens == 128


def _sequence(tokens: list[int]) -> Sequence:
    return Sequence("s", tokens, SamplingParams(max_tokens=1), None, None)


def test_block_manager_shares_evicts_and_keeps_merged_kv_private():
    blocks = BlockManager(num_blocks=5, block_size=4, prefix_caching=True)  # 4 usable blocks
    first = _sequence(list(range(10)))
    blocks.admit(first, blocks.match_prefix(first), 10)
    first.num_cached = 10
    blocks.publish(first)  # two full blocks get hashes
    again = _sequence(list(range(10)))
    prefix = blocks.match_prefix(again)
    assert prefix == first.block_table[:2]
    blocks.admit(again, prefix, 2)
    assert again.num_cached == 8 and again.block_table[:2] == prefix and blocks.num_free_blocks == 0
    blocks.free(first)
    blocks.free(again)
    assert blocks.num_free_blocks == 4  # hashed blocks sit in the evictable pool, which counts as free
    other = _sequence([7] * 16)  # needs all four blocks: both hashed ones are evicted
    assert blocks.match_prefix(other) == []
    blocks.admit(other, [], 16)
    assert blocks.match_prefix(_sequence(list(range(10)))) == []
    assert (blocks.evicted_blocks, blocks.num_cached_blocks) == (2, 0)
    assert (blocks.prefix_hit_tokens, blocks.prefix_query_tokens) == (8, 10 + 10 + 16)
    blocks.free(other)
    merged = _sequence(list(range(10)))
    blocks.admit(merged, [], 10)
    merged.num_cached, merged.kv_shareable = 10, False  # a step ran on merged weights
    blocks.publish(merged)
    assert blocks.match_prefix(_sequence(list(range(10)))) == []
    blocks.free(merged)
    assert blocks.num_free_blocks == 4


def test_blocks_key_the_adapter_by_its_weights_digest_not_its_name():
    """A name registered again with new weights is another adapter to the cache (its K/V differ); two
    names for the very same files are one."""
    def hashes(adapter: AdapterRef | None) -> list[bytes]:
        seq = Sequence("s", list(range(9)), SamplingParams(max_tokens=1), adapter, None)
        return [block_hash(seq, index, 4) for index in range(2)]

    v1 = AdapterRef("sql", DEMO_BASE_MODEL, 8, "a1" * 32, "/store/a1")
    v2 = dataclasses.replace(v1, sha256="b2" * 32, storage_path="/store/b2")
    alias = dataclasses.replace(v1, name="sql-copy")
    assert hashes(alias) == hashes(v1)
    assert not set(hashes(v1)) & set(hashes(v2)) and not set(hashes(v1)) & set(hashes(None))
