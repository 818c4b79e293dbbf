"""The worker of `tessera up` with worker.cpu_lora_workers: its CPU LoRA worker runs pinned to a core
of its own, the worker's standard health service reports it, and one killed is started again."""

from __future__ import annotations

import time

import psutil
import pytest

from gpu_worker.server import CPU_LORA_HEALTH_SERVICE
from services.common.grpc_server import check_health
from services.common.cpu_lora.numa import allowed_cpus
from services.common.tls import health_probe_credentials

pytestmark = pytest.mark.integration


def _cpu_lora_workers(system) -> list[psutil.Process]:
    """The worker's live CPU LoRA workers (not one killed and not yet reaped)."""
    found = []
    for child in psutil.Process(system.child_pid("worker")).children():
        try:
            if "cpu_lora_worker" in " ".join(child.cmdline()):
                found.append(child)
        except psutil.ZombieProcess:
            pass
    return found


def _serving(system) -> bool:
    return check_health(system.worker_grpc, timeout_s=2.0, service=CPU_LORA_HEALTH_SERVICE,
                        credentials=health_probe_credentials(system.config, "worker"))


def _until(condition, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def test_the_cpu_lora_worker_runs_pinned_is_reported_and_restarted(system):
    _until(lambda: _serving(system))
    (first,) = _cpu_lora_workers(system)
    cores = allowed_cpus(first.pid)
    assert len(cores) == 1 and cores != allowed_cpus(system.child_pid("worker"))  # a core of its own
    first.kill()

    def restarted() -> bool:  # a new one, pinned as the first was, and the health says it answers
        workers = _cpu_lora_workers(system)
        return (len(workers) == 1 and workers[0].pid != first.pid and allowed_cpus(workers[0].pid) == cores
                and _serving(system))
    _until(restarted)
