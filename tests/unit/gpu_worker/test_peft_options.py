"""PEFT's per-module options, served as PEFT serves them: rsLoRA (scaling alpha / sqrt(r)), rank_pattern
and alpha_pattern (a rank and an alpha of a module's own, matched by name or regex). Real PEFT files;
greedy tokens equal transformers + PEFT, unmerged and merged."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from gpu_worker.intake import GenerationRequest
from gpu_worker.lora.loader import AdapterRef, load_adapter
from gpu_worker.models.llama import LORA_TARGETS
from gpu_worker.sequence import SamplingParams
from services.common.adapter_layout import TEXT_LAYOUT, directory_digest
from services.demo_assets import DEMO_BASE_MODEL, DemoAdapterSpec, build_lora_adapter
from tests.reference import ReferenceModels, assert_same_greedy

from .conftest import TINY_LLAMA, run_all, tokens_of

ALL_SEVEN = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Two rank keys match layer 1's q_proj: PEFT takes the first, "layers.1.self_attn.q_proj" (in sorted
# order, as PEFT saves them: created in another order, the saved file would not load in PEFT either).
# Inside the fused qkv projection q, k and v get ranks 12 or 16, 8 and 4; inside gate_up, 8 and 2.
PATTERNS = DemoAdapterSpec(
    "demo-patterns", 8, 16.0, ALL_SEVEN, seed=7, use_rslora=True,
    rank_pattern=(("layers.1.self_attn.q_proj", 16), ("q_proj", 12), ("up_proj", 2), ("v_proj", 4)),
    alpha_pattern=(("k_proj", 5.0), ("model.layers.0.mlp.down_proj", 3.0), ("q_proj", 32.0)))
PROMPT = "import os\nimport sys\n"
MAX_NEW = 12


def _ref(tiny_assets, spec: DemoAdapterSpec) -> AdapterRef:
    """Built into the worker's store and recorded as the registry records it: at its largest rank."""
    directory = build_lora_adapter(tiny_assets.base_dir, tiny_assets.store / spec.name, spec)
    rank = max(spec.rank, *(r for _, r in spec.rank_pattern))
    return AdapterRef(spec.name, DEMO_BASE_MODEL, rank, directory_digest(directory), str(directory))


@pytest.fixture(scope="module")
def patterns(tiny_assets) -> AdapterRef:
    return _ref(tiny_assets, PATTERNS)


@pytest.fixture(scope="module")
def reference(tiny_assets, patterns) -> ReferenceModels:
    return ReferenceModels(DEMO_BASE_MODEL, tiny_assets.base_dir, {patterns.name: patterns.storage_path})


@pytest.mark.parametrize("use_rslora", [True, False])
def test_every_module_gets_the_rank_scaling_and_weights_peft_gives_it(tiny_assets, use_rslora):
    spec = dataclasses.replace(PATTERNS, name=f"patterns-rslora-{use_rslora}", use_rslora=use_rslora)
    ref = _ref(tiny_assets, spec)
    weights = load_adapter(ref, tiny_assets.store, TEXT_LAYOUT, LORA_TARGETS, num_layers=2, hidden_size=TINY_LLAMA.hidden_size)

    base = AutoModelForCausalLM.from_pretrained(tiny_assets.base_dir, dtype=torch.float32)
    peft_layers = {name: m for name, m in PeftModel.from_pretrained(base, ref.storage_path).named_modules()
                   if hasattr(m, "lora_A") and "default" in m.lora_A}
    assert len(peft_layers) == len(weights.modules) == 2 * len(ALL_SEVEN)
    for (layer, target), (a, b, scaling) in weights.modules.items():
        peft = peft_layers[f"base_model.model.model.layers.{layer}.{LORA_TARGETS[target]}"]
        assert a.shape[0] == peft.r["default"], (layer, target)
        assert math.isclose(scaling, peft.scaling["default"], rel_tol=1e-12), (layer, target)
        assert torch.equal(a, peft.lora_A["default"].weight) and torch.equal(b, peft.lora_B["default"].weight)
    ranks = {key: m.a.shape[0] for key, m in weights.modules.items()}
    assert (ranks[(0, "q_proj")], ranks[(1, "q_proj")], ranks[(1, "k_proj")], ranks[(1, "v_proj")]) == (12, 16, 8, 4)
    assert weights.rank == ref.rank == 16


def test_rslora_and_patterns_generate_as_peft_does_batched_with_another_adapter(
        engine_factory, tiny_assets, patterns, reference):
    expected = reference.greedy_text(patterns.name, PROMPT, MAX_NEW)
    assert expected.tokens != reference.greedy_text(DEMO_BASE_MODEL, PROMPT, MAX_NEW).tokens  # the test's power
    engine = engine_factory()
    other = tiny_assets.adapters["demo-r16"]
    requests = [GenerationRequest(f"p{i}", PROMPT, SamplingParams(max_tokens=MAX_NEW), adapter)
                for i, adapter in enumerate((patterns, other, patterns))]
    results = run_all(engine, requests)
    for outputs in results[::2]:
        assert_same_greedy(patterns.name, expected, tokens_of(outputs))

    # Layer 1's fused qkv holds q, k and v at their own ranks and scalings (alpha / sqrt(r)).
    slot, rank = engine._adapters.resident(patterns)
    qkv, _ = engine._runner.model.lora_layers(["q_proj"])[(1, "q_proj")]
    assert rank == 16 and qkv.lora.host_ranks[slot] == [16, 8, 4]
    want = [32 / math.sqrt(16), 5 / math.sqrt(8), 16 / math.sqrt(4)]
    assert qkv.lora.host_scalings[slot] == pytest.approx(want, rel=1e-6)


def test_rslora_and_patterns_merged_generate_as_peft_does(engine_factory, patterns, reference):
    steps = []
    engine = engine_factory(steps=steps)
    requests = [GenerationRequest(f"m{i}", PROMPT, SamplingParams(max_tokens=MAX_NEW), patterns) for i in range(2)]
    results = run_all(engine, requests)
    assert any(s.merged_adapter == patterns.name for s in steps)
    expected = reference.greedy_text(patterns.name, PROMPT, MAX_NEW)
    for outputs in results:
        assert_same_greedy(f"merged {patterns.name}", expected, tokens_of(outputs))
