"""`tessera serve cpu-lora`: a GPU worker's CPU LoRA workers, run from another container of its pod (Kubernetes:
a sidecar mounting the same memory volume at worker.cpu_lora_shm_dir; the worker has
worker.cpu_lora_launch: sidecar).

It follows the manifest the GPU worker writes there (services/common/lora_shm.py, SidecarManifest): it runs
that many CPU LoRA workers on the files the manifest names, each pinned to its share of the cores this
container was given (the static CPU manager gives a Guaranteed pod's integer CPUs to it alone), starts one
that died again, kills one the GPU worker found stuck, and marks each live one in the work area every
BEAT_S, so that the GPU worker sends jobs only to workers that are there. A new manifest (the GPU worker
started again) moves them to the new files.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from services.common.config import ConfigError, TesseraConfig
from services.common.lora_shm import BEAT, KILL, KILLED, PID, SidecarManifest, WorkArea
from services.common.numa import allowed_cpus, format_cpulist
from services.common.processes import stop_processes

log = logging.getLogger(__name__)

BEAT_S = 0.1


def core_shares(cpus: list[int], workers: int, cores_each: int) -> list[tuple[int, ...]]:
    """`cores_each` of `cpus` for each worker; fewer each (one at least, shared in turn) when there are not
    that many."""
    each = max(1, min(cores_each, len(cpus) // workers))
    return [tuple(cpus[(w * each + k) % len(cpus)] for k in range(each)) for w in range(workers)]


class Sidecar:
    def __init__(self, directory: Path, cores_each: int) -> None:
        self._directory, self._cores_each = directory, cores_each
        self._manifest: SidecarManifest | None = None
        self._area: WorkArea | None = None
        self._cores: list[tuple[int, ...]] = []
        self._procs: list[subprocess.Popen | None] = []
        self.restarts = 0

    def step(self) -> None:
        """One look: follow a new manifest, serve kill requests, start the dead, mark the living."""
        manifest = SidecarManifest.read(self._directory)
        if manifest != self._manifest:
            self._switch(manifest)
        if self._area is None:
            return
        now_ms = int(time.time() * 1e3)
        for index, proc in enumerate(self._procs):
            control = self._area.control[index]
            if int(control[KILL]) > int(control[KILLED]):
                if proc is not None and proc.poll() is None:
                    proc.kill()
                    proc.wait()
                log.warning("killed CPU LoRA worker %d, stuck on a job", index)
                control[KILLED] = control[KILL]
            elif proc is not None and proc.poll() is None:
                control[BEAT] = now_ms
                continue
            elif proc is not None:
                log.warning("CPU LoRA worker %d (pid %d) exited with %s; starting it again", index, proc.pid,
                            proc.returncode)
                self.restarts += 1
            self._spawn(index)
            control[BEAT] = now_ms

    def _switch(self, manifest: SidecarManifest | None) -> None:
        self.stop()
        if manifest is None:
            return
        try:
            area = WorkArea.open(self._directory / manifest.work_area)
        except (OSError, ValueError) as exc:  # the GPU worker may be replacing it: the next look retries
            log.warning("cannot open the work area %s: %s", manifest.work_area, exc)
            return
        if area.shape.workers != manifest.workers:
            area.close()
            log.error("the work area %s holds %d workers, its manifest %d", manifest.work_area,
                      area.shape.workers, manifest.workers)
            return
        self._manifest, self._area = manifest, area
        self._cores = core_shares(allowed_cpus(os.getpid()), manifest.workers, self._cores_each)
        self._procs = [None] * manifest.workers
        log.info("serving %s with %d CPU LoRA workers on cores %s", manifest.work_area, manifest.workers,
                 self._cores)

    def _spawn(self, index: int) -> None:
        assert self._area is not None and self._manifest is not None
        self._area.control[index, PID] = 0  # the new process writes its own once it answers
        self._procs[index] = subprocess.Popen(
            [sys.executable, "-m", "cpu_lora_worker", "--work-area", str(self._area.path),
             "--weights", str(self._directory / self._manifest.weights), "--index", str(index),
             "--cores", format_cpulist(self._cores[index]), "--dtype", self._manifest.dtype,
             "--parent", str(os.getpid())])

    def stop(self) -> None:
        stop_processes(self._procs)
        if self._area is not None:
            self._area.close()
        self._manifest, self._area, self._procs = None, None, []


def serve(config: TesseraConfig) -> None:
    worker = config.worker
    directory = Path(worker.cpu_lora_shm_dir)
    if not directory.is_dir():
        raise ConfigError(f"worker.cpu_lora_shm_dir: {directory} is not a directory")
    if worker.cpu_lora_cores_each < 1:
        raise ConfigError("worker.cpu_lora_cores_each must be >= 1")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    sidecar = Sidecar(directory, worker.cpu_lora_cores_each)
    log.info("waiting for a GPU worker's manifest in %s (cores %s)", directory,
             format_cpulist(allowed_cpus(os.getpid())))
    try:
        while not stop.wait(BEAT_S):
            sidecar.step()
    finally:
        sidecar.stop()
