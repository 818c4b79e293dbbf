"""The CPU LoRA workers as children of this process: `python -m cpu_lora_worker` each, pinned to its own
cores (numa.py; memory bound to their node by numactl where it can), watched, and started again when one
dies or was killed stuck. A GPU worker runs its own this way (worker.cpu_lora_launch: process), and a
sidecar container those of the GPU worker beside it (sidecar.py)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from services.common.cpu_lora.numa import allowed_cpus, format_cpulist, membind_prefix
from services.common.cpu_lora.shm import PID, WorkArea
from services.common.processes import stop_processes

log = logging.getLogger(__name__)

START_S = 120.0  # a worker imports torch and measures its rates before it answers


class CpuLoraSupervisor:
    """The processes of one work area's workers, the i-th pinned to `cores[i]`. Not thread-safe: its
    caller takes turns with it (the pool's lock, the sidecar's single loop)."""

    _area: WorkArea    # set by `serve`: the files they run on,
    _files: list[str]  # and the arguments naming them

    def __init__(self, cores: Sequence[tuple[int, ...]], node: int | None = None) -> None:
        assert cores, "one worker at least"
        self._cores = list(cores)
        self._membind = membind_prefix(node) if node is not None else []
        self._procs: list[subprocess.Popen | None] = [None] * len(cores)
        self.restarts = 0

    @property
    def count(self) -> int:
        return len(self._cores)

    def serve(self, area: WorkArea, weights: Path, dtype: str) -> None:
        """Start every worker on `area` and the weights region `weights` of `dtype` (as cpu_lora_worker's
        --dtype takes it); each answers once it has measured its rates (`wait_ready`)."""
        assert area.shape.workers == self.count, f"a work area of {area.shape.workers} workers for {self.count}"
        self._area = area
        self._files = ["--work-area", str(area.path), "--weights", str(weights), "--dtype", dtype]
        for index in range(self.count):
            self._start(index)

    def wait_ready(self, timeout_s: float = START_S) -> None:
        """Until every worker answers, running on the cores it was given (read back from /proc).
        RuntimeError when one exits first, does not answer within `timeout_s`, or runs elsewhere."""
        deadline = time.monotonic() + timeout_s
        while not all(map(self.ready, range(self.count))):
            if time.monotonic() > deadline or any(p is not None and p.poll() is not None for p in self._procs):
                raise RuntimeError("CPU LoRA workers did not start (see their logs)")
            time.sleep(0.02)
        for index, proc in enumerate(self._procs):
            assert proc is not None
            if allowed_cpus(proc.pid) != sorted(self._cores[index]):
                raise RuntimeError(f"CPU LoRA worker {index} runs on CPUs {allowed_cpus(proc.pid)}, "
                                   f"not the {sorted(self._cores[index])} it was given")

    def restart_exited(self) -> None:
        """Start again every worker that has exited (died, or killed stuck)."""
        for index, proc in enumerate(self._procs):
            if proc is not None and proc.poll() is not None:
                log.warning("CPU LoRA worker %d (pid %d) exited with %s; starting it again", index, proc.pid,
                            proc.returncode)
                self.restarts += 1
                self._start(index)

    def running(self, index: int) -> bool:
        proc = self._procs[index]
        return proc is not None and proc.poll() is None

    def ready(self, index: int) -> bool:
        """Running, and answering: the process wrote its pid once it measured its rates."""
        proc = self._procs[index]
        return proc is not None and proc.poll() is None and int(self._area.control[index, PID]) == proc.pid

    def kill(self, index: int) -> None:
        """A stuck worker: gone before this returns, so that it cannot write into a later job's rows."""
        proc = self._procs[index]
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def stop(self) -> None:
        stop_processes(self._procs)

    def _start(self, index: int) -> None:
        self._area.control[index, PID] = 0  # the new process writes its own once it answers
        # Started as the roles themselves are (`python -m services.cli`): this interpreter, environment
        # and working directory find the package. `--parent`: it exits once this process is gone.
        self._procs[index] = subprocess.Popen(
            [*self._membind, sys.executable, "-m", "cpu_lora_worker", *self._files, "--index", str(index),
             "--cores", format_cpulist(self._cores[index]), "--parent", str(os.getpid())])
