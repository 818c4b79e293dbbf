"""Tower LoRA on a CUDA device: the CPU tests of tests/unit/gpu_worker/test_vision_tower_lora.py (PEFT's greedy
tokens for LLaVA and Qwen2-VL adapters on the vision tower and projector, a mixed batch in one encoder pass, a
replaced adapter's new features) run here on float32 CUDA engines."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.conftest import cuda_engines
from tests.unit.gpu_worker.conftest import llava_assets, qwen2vl_assets, tiny_assets  # noqa: F401
from tests.unit.gpu_worker.test_vision_tower_lora import (  # noqa: F401 (fixtures and tests run here on CUDA)
    llava_reference, llava_tower, test_mixed_tower_batch_is_one_encoder_pass_and_matches_peft,
    test_qwen2vl_tower_adapter_matches_peft, test_replaced_adapter_serves_its_new_tower,
    test_tower_adapters_change_the_reference_output)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture
def llava_engine_factory(llava_assets):  # noqa: F811
    yield from cuda_engines(llava_assets)


@pytest.fixture
def qwen2vl_engine_factory(qwen2vl_assets):  # noqa: F811
    yield from cuda_engines(qwen2vl_assets)
