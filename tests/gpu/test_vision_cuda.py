"""Vision-language models in the engine on a CUDA device (run through the device tool: `pytest -m gpu tests/gpu`).

For LLaVA-1.5 and Qwen2-VL alike: float32 on the GPU must give transformers + PEFT's greedy tokens on
the same GPU for the mixed image, text and adapter batch of the model's CPU test
(tests/unit/gpu_worker/test_vision_{llava,qwen2vl}.py), with decode CUDA graphs, and with chunked
prefill and preemption; bfloat16 must serve the same batch end to end.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import pytest
import torch

from gpu_worker.vision.qwen2vl_processor import Qwen2VLPromptProcessor
from tests.reference import VisionReferenceModels, assert_same_greedy
from tests.unit.gpu_worker import test_vision_llava, test_vision_qwen2vl
from tests.unit.gpu_worker.conftest import (llava_assets, make_engine, qwen2vl_assets, run_all,  # noqa: F401
                                            tiny_assets, tokens_of)
from tests.unit.gpu_worker.test_vision_llava import _processor_messages

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@dataclass(frozen=True)
class VisionModel:
    assets_fixture: str
    cases: ModuleType       # the CPU test module: CASES, PROMPTS, MAX_NEW, _requests
    kv_cache_tokens: int    # a pool of 8-token blocks too small for the batch: forces preemption
    processor: Any = None   # builds the reference's inputs where AutoProcessor cannot (Qwen2-VL)


MODELS = {
    "llava": VisionModel("llava_assets", test_vision_llava, kv_cache_tokens=96),
    "qwen2vl": VisionModel("qwen2vl_assets", test_vision_qwen2vl, kv_cache_tokens=80,
                           processor=Qwen2VLPromptProcessor),
}
SETUPS = ("graphs", "preempt_chunked")  # the latter: a 7-token budget also splits every image


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request) -> tuple[VisionModel, Any]:
    spec = MODELS[request.param]
    return spec, request.getfixturevalue(spec.assets_fixture)


@pytest.fixture(scope="module")
def cuda_reference(model):
    spec, assets = model
    processor = spec.processor.from_pretrained(assets.base_dir) if spec.processor else None
    models = VisionReferenceModels(assets.name, assets.base_dir, {n: r.storage_path for n, r in assets.adapters.items()},
                                   device="cuda", processor=processor)

    @functools.cache
    def greedy(adapter: str | None, key: str):
        return models.greedy_messages(adapter or assets.name, _processor_messages(spec.cases.PROMPTS[key]),
                                      spec.cases.MAX_NEW)
    return greedy


@pytest.mark.parametrize("setup", SETUPS)
def test_float32_on_cuda_equals_peft_on_cuda(model, cuda_reference, setup):
    spec, assets = model
    limits = {"kv_cache_tokens": spec.kv_cache_tokens, "kv_block_size": 8, "max_batch_tokens": 7} \
        if setup == "preempt_chunked" else {}
    steps = []
    engine = make_engine(assets, steps, device="cuda", dtype="float32", **limits)
    try:
        results = run_all(engine, spec.cases._requests(assets, spec.cases.CASES, setup))
    finally:
        engine.stop()
    for (adapter, key), outputs in zip(spec.cases.CASES, results):
        assert_same_greedy(f"{setup} {adapter}: {key}", cuda_reference(adapter, key), tokens_of(outputs))
    if setup == "preempt_chunked":
        assert sum(step.num_preempted for step in steps) > 0


def test_bfloat16_on_cuda_serves_images(model):
    spec, assets = model
    engine = make_engine(assets, device="cuda", dtype="auto")
    try:
        results = run_all(engine, spec.cases._requests(assets, spec.cases.CASES, "bf16"))
    finally:
        engine.stop()
    assert all(len(tokens_of(outputs)) >= 1 for outputs in results)
