"""The adapter tiers on CUDA: host copies page-locked, GPU installs on a side stream behind an event,
and the engine-level checks of tests/unit/gpu_worker/test_adapter_tiers_engine.py and
test_cpu_assist.py (the host tier page-locked in /dev/shm, CPU LoRA workers beside a CUDA engine) on a
float32 CUDA engine against transformers + PEFT on the same GPU."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.lora.adapter_manager import AdapterManager
from gpu_worker.lora.host_weights import HostPages, host_buffer
from gpu_worker.lora.loader import LoRAModule, LoRAWeights
from policy.eviction import LRU
from services.demo_assets import DEMO_BASE_MODEL
from tests.reference import ReferenceModels, assert_same_greedy
from tests.unit.gpu_worker.adapter_fakes import IN, OUT, Disk, installed, poll_until, ref, tiny_memory
from tests.unit.gpu_worker.test_cpu_assist import (  # noqa: F401 (run here on CUDA)
    COLD,
    COLD_PROMPT,
    MAX_NEW,
    WARM,
    WARM_NEW,
    WARM_PROMPT,
    StepHook,
    _serve_cold_beside_warm,
    test_a_cold_request_runs_on_cpu_lora_workers_then_switches_mid_prefill,
    test_a_cpu_lora_worker_killed_mid_request_changes_nothing,
)
from tests.unit.gpu_worker.test_adapter_tiers_engine import (  # noqa: F401 (fixtures and tests run here on CUDA)
    demo_r8_v2,
    test_a_new_version_serves_new_requests_while_in_flight_ones_finish_on_the_old_weights,
    test_a_slow_disk_delays_only_the_request_that_waits_for_it,
    test_an_engine_waiting_only_for_a_load_sleeps_until_it_completes,
    test_outputs_equal_peft_from_disk_resident_from_host_and_after_eviction,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def reference(tiny_assets, demo_r8_v2):  # noqa: F811
    dirs = {name: ref.storage_path for name, ref in tiny_assets.adapters.items()}
    return ReferenceModels(DEMO_BASE_MODEL, tiny_assets.base_dir, {**dirs, "demo-r8@v2": demo_r8_v2.storage_path},
                           device="cuda")


def test_host_pages_are_page_locked_once_and_installed_by_copies_behind_an_event():
    weights = LoRAWeights("sql", {(0, "q_proj"): LoRAModule(torch.randn(3, IN), torch.randn(OUT, 3), 0.5)})
    memory, module = tiny_memory(2, device="cuda", dtype=torch.bfloat16)
    pages = HostPages(4096, page_locked=True, page_bytes=128)
    scattered = pages.take(3 * 128)  # taken and kept: the adapter's pages are not one run
    packed = memory.pack(weights, pages)
    assert packed.nbytes == 2 * 64 * 2 and len(packed.pages) == 2  # A and Bᵀ of rank 3, each 64 elements
    stream = torch.cuda.Stream()
    copy = memory.install(1, packed, stream)
    copy.done.synchronize()
    a, b, _ = weights.modules[(0, "q_proj")]
    assert all(torch.equal(have.cpu(), want.bfloat16()) for have, want in zip(installed(module, 1), (a, b)))
    pages.give_back(scattered)


def test_page_locked_buffers_are_released_with_their_tensors():
    for _ in range(50):  # registering a range twice fails: each buffer must be unregistered when freed
        buffer = host_buffer(1 << 20, torch.bfloat16, page_locked=True)
        assert buffer.is_pinned()
        del buffer


def test_an_adapter_taken_while_its_copy_runs_is_read_only_after_the_copy():
    """The scheduler may run an adapter whose copy onto the GPU is still queued (layer-pipelined loading),
    each projection waiting on the device for its own bytes' event. With the side stream held busy (a
    long sleep kernel ahead of the copy), the slot read after that wait holds the adapter's weights."""
    memory, module = tiny_memory(2, device="cuda", dtype=torch.float32)
    disk = Disk()
    adapters = AdapterManager(memory, disk.read, host_bytes=4 * memory.max_bytes, host_page_bytes=memory.max_bytes,
                              loader_threads=1, eviction=LRU(), failure_ttl_s=10.0)
    sql = ref("sql")
    disk.hold(sql)
    adapters.arrive(sql)
    with torch.cuda.stream(adapters._stream):  # the manager's side stream: its copies queue behind this
        torch.cuda._sleep(int(5e8))
    disk.release(sql)
    poll_until(adapters, lambda: adapters.where(sql).copy is not None)
    copy = adapters.where(sql).copy
    assert not copy.done.query(), "the copy finished before the test could read ahead of it"
    assert adapters.resident(sql) is None  # not usable yet...
    where = adapters.where(sql)  # ...but placed: it may be taken into a step that waits for the copy
    assert not where.usable and where.slot is not None and where.copy is copy
    slot, rank = where.slot, where.rank
    copy.by_module[module].wait()  # what the projection does before its LoRA kernels (layer.py)
    a, b, _ = disk.weights[sql.sha256].modules[(0, "q_proj")]
    assert rank == a.shape[0]
    assert all(torch.equal(have.cpu(), want) for have, want in zip(installed(module, slot), (a, b)))
    poll_until(adapters, lambda: adapters.where(sql).copy is None)
    assert adapters.resident(sql) == (slot, rank)
    adapters.close()


def test_a_cold_request_starts_beside_a_running_one_while_its_adapter_copies(engine_factory, tiny_assets,
                                                                            reference):
    """Layer-pipelined loading: once WARM runs, a ~300 ms kernel holds the manager's side stream, so
    COLD's copy onto the GPU queues behind it; the pipelined policy admits COLD at once into WARM's
    steps, whose projections wait for its bytes on the device. Both outputs equal PEFT's."""
    held = []

    def on_step(record) -> None:
        if not held and "warm" in record.request_ids:  # before COLD arrives
            with torch.cuda.stream(engine._adapters._stream):
                torch.cuda._sleep(int(6e8))
            held.append(dict(engine._scheduler.cold_start.started))  # WARM's own start may count
    steps = StepHook(on_step)
    engine = engine_factory(steps, cold_start_policy="pipelined")
    warm_tokens, cold_tokens = _serve_cold_beside_warm(engine, tiny_assets)
    assert_same_greedy("cold, pipelined", reference.greedy_text(COLD, COLD_PROMPT, MAX_NEW), cold_tokens)
    assert_same_greedy("warm beside it", reference.greedy_text(WARM, WARM_PROMPT, WARM_NEW), warm_tokens)
    assert "warm" in next(record for record in steps if "cold" in record.request_ids).request_ids
    started = engine.stats().cold_starts_total
    assert {way: started[way] - count for way, count in held[0].items()} == {"pipelined": 1, "cpu": 0, "wait": 0}
