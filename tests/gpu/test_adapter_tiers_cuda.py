"""The adapter tiers on CUDA: host copies page-locked, GPU installs on a side stream behind an event,
and the engine-level checks of tests/unit/gpu_worker/test_adapter_tiers_engine.py on a float32
CUDA engine against transformers + PEFT on the same GPU."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.lora.loader import LoRAWeights
from services.demo_assets import DEMO_BASE_MODEL
from tests.reference import ReferenceModels
from tests.unit.gpu_worker.adapter_fakes import IN, OUT, installed, tiny_memory
from tests.unit.gpu_worker.conftest import make_engine, tiny_assets  # noqa: F401 (fixture)
from tests.unit.gpu_worker.test_adapter_tiers_engine import (  # noqa: F401 (fixtures and tests run here on CUDA)
    demo_r8_v2,
    test_a_new_version_serves_new_requests_while_in_flight_ones_finish_on_the_old_weights,
    test_a_slow_disk_delays_only_the_request_that_waits_for_it,
    test_an_engine_waiting_only_for_a_load_sleeps_until_it_completes,
    test_outputs_equal_peft_from_disk_resident_from_host_and_after_eviction,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture
def engine_factory(tiny_assets):  # noqa: F811
    """Float32 CUDA engines (the unit tests' factory, on the GPU)."""
    engines = []

    def factory(steps=None, **fields):
        engines.append(make_engine(tiny_assets, steps, device="cuda", dtype="float32", kv_cache_tokens=2048, **fields))
        return engines[-1]
    yield factory
    for engine in engines:
        engine.stop()


@pytest.fixture(scope="module")
def reference(tiny_assets, demo_r8_v2):  # noqa: F811
    dirs = {name: ref.storage_path for name, ref in tiny_assets.adapters.items()}
    return ReferenceModels(DEMO_BASE_MODEL, tiny_assets.base_dir, {**dirs, "demo-r8@v2": demo_r8_v2.storage_path},
                           device="cuda")


def test_host_copies_are_page_locked_packed_and_installed_by_one_copy_behind_an_event():
    weights = LoRAWeights("sql", 3, 0.5, {(0, "q_proj"): (torch.randn(3, IN), torch.randn(OUT, 3))})
    memory, module = tiny_memory(2, device="cuda", dtype=torch.bfloat16)
    packed = memory.pack(weights, page_locked=True)
    assert packed.buffer.is_pinned() and packed.buffer.dtype == torch.bfloat16
    assert memory.bytes_of(packed) == 2 * 64 * 2  # A and Bᵀ of rank 3, each block aligned to 64 elements
    stream = torch.cuda.Stream()
    event = memory.install(1, packed, stream)
    event.synchronize()
    a, b = weights.modules[(0, "q_proj")]
    assert all(torch.equal(have.cpu(), want.bfloat16()) for have, want in zip(installed(module, 1), (a, b)))


def test_page_locked_buffers_are_released_with_their_tensors():
    from gpu_worker.lora.host_weights import host_buffer
    for _ in range(50):  # registering a range twice fails: each buffer must be unregistered when freed
        buffer = host_buffer(1 << 20, torch.bfloat16, page_locked=True)
        assert buffer.is_pinned()
        del buffer
