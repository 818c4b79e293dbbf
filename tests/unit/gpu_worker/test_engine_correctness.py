"""Greedy tokens from our engine equal transformers + PEFT, alone and batched across adapters."""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from gpu_worker.engine import GenerationRequest
from gpu_worker.sequence import SamplingParams

from .conftest import run_all, tokens_of

MAX_NEW = 12
TIE_GAP = 1e-5
PROMPTS = (
    "def",
    "import os\nimport sys\n",
    "class Handler(object):\n    \"\"\"Handle a request and return its response to the caller.\"\"\"\n    def handle(self, request):\n",
)
ADAPTERS = (None, "demo-r8", "demo-r16", "demo-r64")


@pytest.fixture(scope="module")
def reference(tiny_assets):
    """(adapter, prompt) -> (greedy tokens, per-step logits) from transformers + PEFT."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_assets.base_dir)
    results = {}
    for adapter in ADAPTERS:
        model = AutoModelForCausalLM.from_pretrained(tiny_assets.base_dir, dtype=torch.float32)
        if adapter is not None:
            model = PeftModel.from_pretrained(model, tiny_assets.adapters[adapter].storage_path)
        model.eval()
        for prompt in PROMPTS:
            enc = tokenizer(prompt, return_tensors="pt")
            with torch.no_grad():
                out = model.generate(**enc, do_sample=False, max_new_tokens=MAX_NEW, output_logits=True,
                                     return_dict_in_generate=True, pad_token_id=tokenizer.pad_token_id)
            tokens = out.sequences[0, enc["input_ids"].shape[1]:].tolist()
            results[(adapter, prompt)] = (tokens, [step[0] for step in out.logits])
    return results


def assert_same_greedy(ours: list[int], ref_tokens: list[int], ref_logits: list[torch.Tensor]) -> None:
    """Token-exact, except at a genuine tie: there our token must be as likely as the reference's."""
    for step, (mine, theirs) in enumerate(zip(ours, ref_tokens)):
        if mine == theirs:
            continue
        logprobs = torch.log_softmax(ref_logits[step].double(), dim=-1)
        top2 = logprobs.topk(2).values
        assert top2[0] - top2[1] < TIE_GAP, f"step {step}: ours {mine} vs reference {theirs}, no tie\n{ours}\n{ref_tokens}"
        assert logprobs[theirs] - logprobs[mine] < TIE_GAP, f"step {step}: our token {mine} is not a top tie"
        return  # past a tie the continuations legitimately diverge
    assert len(ours) == len(ref_tokens), (ours, ref_tokens)


def _request(adapter: str | None, prompt: str, tiny_assets, index: int) -> GenerationRequest:
    ref = tiny_assets.adapters[adapter] if adapter else None
    return GenerationRequest(f"r{index}-{adapter}", prompt, SamplingParams(max_tokens=MAX_NEW), ref)


def test_adapters_change_the_reference_output(reference):
    """Guards the test's power: every adapter's greedy tokens differ from the base model's."""
    for prompt in PROMPTS:
        base = reference[(None, prompt)][0]
        for adapter in ADAPTERS[1:]:
            assert reference[(adapter, prompt)][0] != base, (adapter, prompt)


def test_one_at_a_time_matches_transformers_and_peft(engine_factory, tiny_assets, reference):
    engine = engine_factory(adapter_slots=2)  # fewer slots than adapters: eviction happens too
    for i, adapter in enumerate(ADAPTERS):
        for j, prompt in enumerate(PROMPTS):
            (outputs,) = run_all(engine, [_request(adapter, prompt, tiny_assets, 10 * i + j)])
            assert_same_greedy(tokens_of(outputs), *reference[(adapter, prompt)])


def test_concurrent_mixed_adapters_share_batches_and_match(engine_factory, tiny_assets, reference):
    steps = []
    # A small token budget admits the long prompts over several steps, next to running decodes.
    engine = engine_factory(steps=steps, max_batch_tokens=64)
    cases = [(adapter, PROMPTS[i % len(PROMPTS)]) for i, adapter in enumerate(ADAPTERS * 2)]
    requests = [_request(a, p, tiny_assets, i) for i, (a, p) in enumerate(cases)]
    results = run_all(engine, requests)
    for (adapter, prompt), outputs in zip(cases, results):
        assert_same_greedy(tokens_of(outputs), *reference[(adapter, prompt)])
    # They really ran together: one forward pass held every adapter and the base model at once,
    # and prefills were packed with decodes of other requests.
    assert any(set(step.adapters) == set(ADAPTERS) for step in steps), steps[:3]
    assert max(len(step.request_ids) for step in steps) == len(requests)
    assert any(0 < step.num_prefills < len(step.request_ids) for step in steps), steps[:3]
