"""Qwen2-VL in the engine on a CUDA device (run through the device tool: `pytest -m gpu tests/gpu`).

float32 on the GPU must give transformers + PEFT's greedy tokens on the same GPU for the mixed image,
text and adapter batch of tests/unit/gpu_worker/test_vision_qwen2vl.py (M-RoPE positions in prefill
chunks, 1-D positions in the decode CUDA graphs), with chunked prefill and preemption; bfloat16 must
serve the same batch end to end.
"""

from __future__ import annotations

import functools

import pytest
import torch

from gpu_worker.vision.qwen2vl_processor import Qwen2VLPromptProcessor
from tests.reference import VisionReferenceModels, assert_same_greedy
from tests.unit.gpu_worker.conftest import make_engine, qwen2vl_assets, run_all, tiny_assets, tokens_of  # noqa: F401
from tests.unit.gpu_worker.test_vision_qwen2vl import CASES, MAX_NEW, PROMPTS, _processor_messages, _requests

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SETUPS = {
    "graphs": {},
    # an 80-token KV pool of 8-token blocks forces preemption; a 7-token budget splits every image
    "preempt_chunked": {"kv_cache_tokens": 80, "kv_block_size": 8, "max_batch_tokens": 7},
}


@pytest.fixture(scope="module")
def cuda_reference(qwen2vl_assets):
    models = VisionReferenceModels(qwen2vl_assets.name, qwen2vl_assets.base_dir,
                                   {n: r.storage_path for n, r in qwen2vl_assets.adapters.items()}, device="cuda",
                                   processor=Qwen2VLPromptProcessor.from_pretrained(qwen2vl_assets.base_dir))

    @functools.cache
    def greedy(adapter: str | None, key: str):
        return models.greedy_messages(adapter or qwen2vl_assets.name, _processor_messages(PROMPTS[key]), MAX_NEW)
    return greedy


@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_float32_on_cuda_equals_peft_on_cuda(qwen2vl_assets, cuda_reference, setup):
    steps = []
    engine = make_engine(qwen2vl_assets, steps, device="cuda", dtype="float32", **SETUPS[setup])
    try:
        results = run_all(engine, _requests(qwen2vl_assets, CASES, setup))
    finally:
        engine.stop()
    for (adapter, key), outputs in zip(CASES, results):
        assert_same_greedy(f"{setup} {adapter}: {key}", cuda_reference(adapter, key), tokens_of(outputs))
    if setup == "preempt_chunked":
        assert sum(step.num_preempted for step in steps) > 0


def test_bfloat16_on_cuda_serves_images(qwen2vl_assets):
    engine = make_engine(qwen2vl_assets, device="cuda", dtype="auto")
    try:
        results = run_all(engine, _requests(qwen2vl_assets, CASES, "bf16"))
    finally:
        engine.stop()
    assert all(len(tokens_of(outputs)) >= 1 for outputs in results)
