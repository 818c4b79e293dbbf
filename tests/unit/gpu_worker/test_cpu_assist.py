"""CPU-assisted prefill in a running engine (tiny Llama, real PEFT adapters, real CPU LoRA worker
processes): a request whose adapter cannot be placed on the GPU while another request holds the GPU
tier starts at once with its LoRA deltas computed by the CPU LoRA workers, in steps it shares with
the warm request, then switches to the GPU kernels mid-prefill once the adapter lands; its greedy
output equals transformers + PEFT. A CPU LoRA worker killed mid-request costs nothing: the worker
computes the missing shares itself and the pool starts it again."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from gpu_worker.engine import StepRecord
from gpu_worker.intake import GenerationRequest
from gpu_worker.lora.cpu_assist import workers_for
from gpu_worker.metrics import CpuLoraMetrics
from gpu_worker.sequence import SamplingParams
from services.common.lora_shm import REQUEST
from services.common.numa import allowed_cpus
from services.demo_assets import DEMO_BASE_MODEL
from tests.reference import ReferenceModels, assert_same_greedy

from .conftest import idle_stats
from .test_adapter_tiers_engine import _packed_bytes

WARM, COLD = "demo-r64", "demo-r16"
WARM_PROMPT = "import os\nimport sys\n"
COLD_PROMPT = "for i in range(10):\n    print(i)\n" * 8  # prefilled in several chunks of max_batch_tokens
MAX_NEW = 12
WARM_NEW = 200  # it outlives the cold request unless aborted


class StepHook(list):
    """The engine's step records (make_engine appends them), each also shown to `on_step`."""

    def __init__(self, on_step) -> None:
        super().__init__()
        self.on_step = on_step

    def append(self, record: StepRecord) -> None:
        super().append(record)
        self.on_step(record)


@pytest.fixture(scope="module")
def reference(tiny_assets) -> ReferenceModels:
    return ReferenceModels(DEMO_BASE_MODEL, tiny_assets.base_dir,
                           {name: ref.storage_path for name, ref in tiny_assets.adapters.items()})


def _engine(engine_factory, tiny_assets, tmp_path, steps: StepHook, warm: str = WARM, cold: str = COLD):
    """GPU adapter memory for the larger of `warm` and `cold` alone: while a request holds `warm` there,
    `cold` cannot be placed. The shared files in /dev/shm, as served (on CUDA the host tier is
    page-locked there)."""
    sizes = _packed_bytes(engine_factory, tiny_assets)
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else str(tmp_path)
    return engine_factory(steps, adapter_gpu_bytes=max(sizes[warm], sizes[cold]),
                          adapter_host_bytes=8 * sum(sizes.values()),
                          cpu_lora_workers=1, cpu_lora_shm_dir=shm, max_batch_tokens=24)


def _serve_cold_beside_warm(engine, tiny_assets, warm_name: str = WARM, cold_name: str = COLD
                            ) -> tuple[list[int], list[int]]:
    """A long request on `warm_name` runs; one on `cold_name` arrives. -> (their tokens)."""
    async def main():
        loop = asyncio.get_running_loop()
        warm = aiter(engine.submit(GenerationRequest("warm", WARM_PROMPT, SamplingParams(max_tokens=WARM_NEW),
                                                     tiny_assets.adapters[warm_name]), loop))
        first = await anext(warm)  # running: WARM holds the GPU tier
        cold = engine.submit(GenerationRequest("cold", COLD_PROMPT, SamplingParams(max_tokens=MAX_NEW),
                                               tiny_assets.adapters[cold_name]), loop)
        cold_tokens = [t async for out in cold for t in out.token_ids]
        warm_tokens = first.token_ids + [t async for out in warm for t in out.token_ids]
        return warm_tokens, cold_tokens
    return asyncio.run(main())


def test_a_cold_request_runs_on_cpu_lora_workers_then_switches_mid_prefill(engine_factory, tiny_assets, tmp_path,
                                                                          reference):
    cold_steps = []

    def on_step(record: StepRecord) -> None:
        if "cold" in record.request_ids:
            cold_steps.append((record, int(pool.area.control[0, REQUEST])))
            if len(cold_steps) == 1:
                engine.abort("warm")  # WARM leaves the GPU tier: COLD's adapter can be placed now
    engine = _engine(engine_factory, tiny_assets, tmp_path, StepHook(on_step))
    pool = engine._runner.cpu_lora
    assert allowed_cpus(pool._procs[0].pid) == list(pool._cores[0])  # pinned where the pool put it

    _, cold_tokens = _serve_cold_beside_warm(engine, tiny_assets)
    assert_same_greedy("cold, CPU-assisted then on the GPU", reference.greedy_text(COLD, COLD_PROMPT, MAX_NEW),
                       cold_tokens)
    first_record, jobs_after_first = cold_steps[0]
    assert first_record.num_prefills and "warm" in first_record.request_ids  # one step, warm beside cold
    assert jobs_after_first > 0  # its LoRA ran on the CPU LoRA worker
    prefill_steps = [jobs for record, jobs in cold_steps if record.num_prefills]
    assert len(prefill_steps) >= 3 and prefill_steps[-1] == prefill_steps[-2]  # later chunks: no CPU job
    stats = idle_stats(engine)
    assert COLD in stats.adapters.gpu_adapters
    assert (stats.cold_starts_total["cpu"], stats.cpu_lora.workers, stats.cpu_lora.ready) == (1, 1, 1)
    assert stats.cpu_lora.jobs == prefill_steps[-1] and stats.cpu_lora.local_shares == 0
    metrics = CollectorRegistry()
    metrics.register(CpuLoraMetrics(engine))
    text = generate_latest(metrics).decode()
    for line in ('tessera_worker_cpu_lora_workers{state="ready"} 1.0',
                 'tessera_worker_cold_starts_total{way="cpu"} 1.0',
                 f"tessera_worker_cpu_lora_jobs_total {float(prefill_steps[-1])}"):
        assert line in text, line


@pytest.mark.parametrize("warm, cold", [("demo-r64", "demo-r8"), ("demo-r8", "demo-r64")])
def test_every_rank_and_target_set_gives_peft_outputs_from_cpu_lora_workers(engine_factory, tiny_assets, tmp_path,
                                                                            reference, warm, cold):
    """demo-r8 (q,v), demo-r16 (q,k,v,o; the test above) and demo-r64 (all seven, ranks per module),
    each cold beside another running adapter: CPU-assisted, then on the GPU once the other leaves."""
    def on_step(record: StepRecord) -> None:
        if "cold" in record.request_ids and not started:
            started.append(int(engine._runner.cpu_lora.area.control[0, REQUEST]))  # CPU jobs by then
            engine.abort("warm")
    started: list[int] = []
    engine = _engine(engine_factory, tiny_assets, tmp_path, StepHook(on_step), warm, cold)
    _, cold_tokens = _serve_cold_beside_warm(engine, tiny_assets, warm, cold)
    assert_same_greedy(f"{cold}, CPU-assisted then on the GPU", reference.greedy_text(cold, COLD_PROMPT, MAX_NEW),
                       cold_tokens)
    assert started[0] > 0 and idle_stats(engine).cold_starts_total["cpu"] == 1


def test_a_cpu_lora_worker_killed_mid_request_changes_nothing(engine_factory, tiny_assets, tmp_path, reference):
    killed = []

    def on_step(record: StepRecord) -> None:
        if "cold" in record.request_ids and not killed:
            os.kill(victim, signal.SIGKILL)  # before the next step's jobs
            killed.append(record.step)
    engine = _engine(engine_factory, tiny_assets, tmp_path, StepHook(on_step))
    pool = engine._runner.cpu_lora
    victim = pool._procs[0].pid

    warm_tokens, cold_tokens = _serve_cold_beside_warm(engine, tiny_assets)
    assert_same_greedy("cold, its CPU LoRA worker killed", reference.greedy_text(COLD, COLD_PROMPT, MAX_NEW),
                       cold_tokens)
    assert_same_greedy("warm beside it", reference.greedy_text(WARM, WARM_PROMPT, WARM_NEW), warm_tokens)
    deadline = time.monotonic() + 60
    while not pool.live() and time.monotonic() < deadline:  # started again
        time.sleep(0.1)
    assert pool.restarts == 1 and pool._procs[0].pid != victim and pool.live() == [0]
    assert engine.stats().cpu_lora.local_shares > 0  # the shares of the dead worker, computed by the engine


@pytest.mark.parametrize("tokens, rate, available, expected", [
    (1, 20_000, 4, 1),        # a decode's token: one worker
    (30, 20_000, 4, 2),       # 1.5 ms of one core's work: two
    (2048, 20_000, 4, 4),     # a long prefill chunk: every worker
    (2048, 0, 3, 3),          # no rate measured yet: every worker
])
def test_a_job_gets_a_worker_per_millisecond_of_a_cores_work(tokens, rate, available, expected):
    assert workers_for(tokens, rate, available) == expected


def test_a_machine_without_cores_for_them_serves_without_cpu_lora_workers(engine_factory, tmp_path, caplog):
    """As on a one-core machine with the default settings: a warning, and no CPU assistance."""
    cores = len(os.sched_getaffinity(0))
    engine = engine_factory(cpu_lora_workers=cores, cpu_lora_shm_dir=str(tmp_path))  # one core stays the worker's
    assert engine._runner.cpu_lora is None and engine.stats().cpu_lora.workers == 0
    assert "no CPU LoRA workers" in caplog.text and not list(tmp_path.iterdir())
