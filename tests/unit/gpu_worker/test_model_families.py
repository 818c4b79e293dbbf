"""Every family the model runner serves, from sharded checkpoints: the engine's greedy tokens equal
transformers + PEFT for Qwen2 (q/k/v bias, tied embeddings), Mistral, and Llama with llama3 rope
scaling, each alone and with an adapter in one batch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, MistralConfig, PreTrainedTokenizerFast, Qwen2Config
from transformers import AutoModelForCausalLM

from gpu_worker.builder import build_engine
from gpu_worker.intake import GenerationRequest
from gpu_worker.lora.loader import AdapterRef
from gpu_worker.sequence import SamplingParams
from services.common.adapter_layout import directory_digest
from services.common.config import WorkerConfig
from services.demo_assets import DemoAdapterSpec, build_lora_adapter
from tests.reference import ReferenceModels, assert_same_greedy

from .conftest import run_all, tokens_of

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.08)
FAMILIES = {
    "qwen2": lambda vocab: Qwen2Config(vocab_size=vocab, tie_word_embeddings=True, **SMALL),
    # a window shorter than the context: the engine serves contexts up to the window
    "mistral": lambda vocab: MistralConfig(vocab_size=vocab, sliding_window=128, tie_word_embeddings=False, **SMALL),
    "llama3_rope": lambda vocab: LlamaConfig(
        vocab_size=vocab, tie_word_embeddings=False, **SMALL,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 32}),
}
ADAPTER = DemoAdapterSpec("family-r8", 8, 16.0, ("q_proj", "k_proj", "v_proj", "o_proj", "down_proj"), 5)
PROMPTS = ("def", "import os\nimport sys\nclass Handler(object):\n    def handle(self, request):\n")
MAX_NEW = 10


def _save_sharded(family: str, root: Path, tokenizer_dir: Path) -> Path:
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    config = FAMILIES[family](len(tokenizer))
    config.bos_token_id, config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    torch.manual_seed(11)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32).eval()
    directory = root / family
    model.save_pretrained(directory, safe_serialization=True, max_shard_size="100KB")
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_assets(request, tiny_assets, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    base = _save_sharded(request.param, root, tiny_assets.base_dir)
    store = root / "store"
    adapter_dir = build_lora_adapter(base, store / ADAPTER.name, ADAPTER)
    ref = AdapterRef(ADAPTER.name, request.param, ADAPTER.rank, directory_digest(adapter_dir), str(adapter_dir))
    return request.param, base, store, ref


def test_checkpoint_is_sharded(family_assets):
    _, base, _, _ = family_assets
    index = json.loads((base / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1


def test_engine_matches_transformers_and_peft(family_assets):
    family, base, store, ref = family_assets
    reference = ReferenceModels(family, base, {ADAPTER.name: ref.storage_path})
    engine = build_engine(base, WorkerConfig(base_model=family, cpu_lora_workers=0), store)
    engine.start()
    try:
        cases = [(adapter, prompt) for adapter in (None, ADAPTER.name) for prompt in PROMPTS]
        requests = [GenerationRequest(f"{family}-{i}", prompt, SamplingParams(max_tokens=MAX_NEW),
                                      ref if adapter else None) for i, (adapter, prompt) in enumerate(cases)]
        results = run_all(engine, requests)
    finally:
        engine.stop()
    for (adapter, prompt), outputs in zip(cases, results):
        expected = reference.greedy_text(adapter or family, prompt, MAX_NEW)
        assert_same_greedy(f"{family} {adapter}: {prompt!r}", expected, tokens_of(outputs))
    # The adapter really changes this family's output (the comparison has power).
    assert reference.greedy_text(ADAPTER.name, PROMPTS[1], MAX_NEW).tokens != \
        reference.greedy_text(family, PROMPTS[1], MAX_NEW).tokens


def test_sliding_window_caps_the_context(family_assets):
    family, base, store, _ = family_assets
    engine = build_engine(base, WorkerConfig(base_model=family, cpu_lora_workers=0), store)  # not started: nothing to stop
    assert engine.max_context == {"mistral": 128}.get(family, SMALL["max_position_embeddings"])
