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
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from gpu_worker.engine import StepRecord
from gpu_worker.intake import GenerationRequest
from gpu_worker.lora.cpu_assist import workers_for
from gpu_worker.metrics import CpuLoraMetrics
from gpu_worker.sequence import SamplingParams
from services.common.cpu_lora.numa import allowed_cpus
from services.common.cpu_lora.shm import PID, REQUEST
from services.common.cpu_lora.sidecar import SIDECAR_MANIFEST, SidecarManifest
from services.demo_assets import DEMO_BASE_MODEL
from services.launcher.supervisor import stop_process_group
from tests.reference import ReferenceModels, assert_same_greedy

from .conftest import idle_stats
from .test_adapter_tiers_engine import _packed_bytes

WARM, COLD = "demo-r64", "demo-r16"
WARM_PROMPT = "import os\nimport sys\n"
COLD_PROMPT = "for i in range(10):\n    print(i)\n" * 8  # prefilled in several chunks of max_batch_tokens
MAX_NEW = 12
WARM_NEW = 200  # it outlives the cold request unless aborted
REPO_ROOT = Path(__file__).resolve().parents[3]


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
    assert allowed_cpus(pool._workers._procs[0].pid) == list(pool._workers._cores[0])  # pinned where the pool put it

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
    victim = pool._workers._procs[0].pid

    warm_tokens, cold_tokens = _serve_cold_beside_warm(engine, tiny_assets)
    assert_same_greedy("cold, its CPU LoRA worker killed", reference.greedy_text(COLD, COLD_PROMPT, MAX_NEW),
                       cold_tokens)
    assert_same_greedy("warm beside it", reference.greedy_text(WARM, WARM_PROMPT, WARM_NEW), warm_tokens)
    deadline = time.monotonic() + 60
    while not pool.live() and time.monotonic() < deadline:  # started again
        time.sleep(0.1)
    assert pool.restarts == 1 and pool._workers._procs[0].pid != victim and pool.live() == [0]
    assert engine.stats().cpu_lora.local_shares > 0  # the shares of the dead worker, computed by the engine


def _sidecar(shm_dir, tmp_path) -> subprocess.Popen:
    """`tessera serve cpu-lora` in its own process (Kubernetes: its own container), following `shm_dir`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")}
    env |= {"TESSERA_HOME": str(tmp_path / "home"), "TESSERA_WORKER__CPU_LORA_SHM_DIR": str(shm_dir),
            "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.Popen([sys.executable, "-m", "services.cli", "serve", "cpu-lora"], env=env, cwd=REPO_ROOT,
                            start_new_session=True)


def _wait_live(pool, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while pool.live() != [0]:
        assert time.monotonic() < deadline, "the sidecar's CPU LoRA worker never answered"
        time.sleep(0.1)


def test_cpu_lora_workers_run_by_a_sidecar_serve_cold_requests_and_follow_a_restarted_worker(
        engine_factory, tiny_assets, tmp_path, reference):
    """worker.cpu_lora_launch: sidecar. The GPU worker serves without CPU LoRA workers until the sidecar's
    answers; then a cold request's prefill runs on it with PEFT's outputs; the sidecar starts a killed one
    again, and moves to the files of a GPU worker started again (the old files removed)."""
    shm = tmp_path / "shm"
    shm.mkdir()
    sizes = _packed_bytes(engine_factory, tiny_assets)
    settings = dict(adapter_gpu_bytes=max(sizes[WARM], sizes[COLD]), adapter_host_bytes=8 * sum(sizes.values()),
                    cpu_lora_workers=1, cpu_lora_launch="sidecar", cpu_lora_shm_dir=str(shm), max_batch_tokens=24)
    cold_jobs: list[int] = []

    def on_step(record: StepRecord) -> None:
        if "cold" in record.request_ids and not cold_jobs:
            cold_jobs.append(int(engine._runner.cpu_lora.area.control[0, REQUEST]))
            engine.abort("warm")
    engine = engine_factory(StepHook(on_step), **settings)
    pool = engine._runner.cpu_lora
    assert pool.live() == [] and idle_stats(engine).cpu_lora.ready == 0  # no sidecar yet: serving without
    sidecar = _sidecar(shm, tmp_path)
    try:
        _wait_live(pool)
        _, cold_tokens = _serve_cold_beside_warm(engine, tiny_assets)
        assert_same_greedy("cold, on the sidecar's CPU LoRA worker", reference.greedy_text(COLD, COLD_PROMPT, MAX_NEW),
                           cold_tokens)
        assert cold_jobs[0] > 0 and idle_stats(engine).cold_starts_total["cpu"] == 1

        first_pid = int(pool.area.control[0, PID])
        assert allowed_cpus(first_pid) == allowed_cpus(sidecar.pid)[:1]  # pinned to its share of the sidecar's
        os.kill(first_pid, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while int(pool.area.control[0, PID]) in (0, first_pid) or pool.live() != [0]:
            assert time.monotonic() < deadline, "the sidecar did not start its worker again"
            time.sleep(0.1)

        old_files = [p.name for p in shm.iterdir() if p.name.startswith("tessera-") and p.name != SIDECAR_MANIFEST]
        assert len(old_files) == 3, old_files  # its claim, host tier and work area
        engine.stop()
        restarted = engine_factory(None, **settings)  # the GPU worker started again, same volume
        assert not any((shm / name).exists() for name in old_files)
        _wait_live(restarted._runner.cpu_lora)
        assert SidecarManifest.read(shm).work_area == restarted._runner.cpu_lora.area.path.name
    finally:
        stop_process_group(sidecar, signal.SIGTERM, grace_s=20)
    assert sidecar.returncode == 0


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
