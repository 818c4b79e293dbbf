"""CPU LoRA workers run by a sidecar container (worker.cpu_lora_launch: sidecar; Kubernetes runs `tessera serve
cpu-lora` beside the GPU worker, both mounting one memory volume at worker.cpu_lora_shm_dir), and both ends
of the handshake between the two containers:

- whenever the GPU worker starts, it names its work area and weights files in a manifest in the shared
  directory (`SidecarManifest`, written by `SidecarWorkers`);
- the sidecar (`Sidecar`) follows it: it runs that many workers on those files (supervisor.py), each pinned
  to its share of the cores this container was given (the static CPU manager gives a Guaranteed pod's
  integer CPUs to it alone), and marks each in its BEAT control word every BEAT_S;
- the GPU worker sends jobs only to workers marked lately, and has a stuck one killed by asking through the
  KILL / KILLED words (it is not its child, and may be out of its sight).
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from services.common.cpu_lora.numa import allowed_cpus
from services.common.cpu_lora.shm import BEAT, KILL, KILLED, PID, WorkArea
from services.common.cpu_lora.supervisor import CpuLoraSupervisor

log = logging.getLogger(__name__)

SIDECAR_MANIFEST = "tessera-cpu-lora.json"
BEAT_S = 0.1


@dataclass(frozen=True)
class SidecarManifest:
    """What a GPU worker tells the sidecar that runs its CPU LoRA workers: the files to serve, in `directory`
    (a volume both containers mount), rewritten whenever the GPU worker starts again."""
    work_area: str  # file names in the directory, not paths: neither side trusts the other's paths
    weights: str
    dtype: str      # the weights region's, as cpu_lora_worker's --dtype takes it
    workers: int

    def write(self, directory: Path) -> None:
        """Atomically: the sidecar never reads half a manifest."""
        tmp = directory / f".{SIDECAR_MANIFEST}.{os.getpid()}"
        tmp.write_text(json.dumps(self.__dict__))
        os.chmod(tmp, 0o600)
        os.replace(tmp, directory / SIDECAR_MANIFEST)

    @classmethod
    def read(cls, directory: Path) -> SidecarManifest | None:
        """The manifest in `directory`; None if there is none (yet) or it is not one."""
        try:
            fields = json.loads((directory / SIDECAR_MANIFEST).read_text())
            manifest = cls(**fields)
        except (OSError, ValueError, TypeError):
            return None
        names_ok = all(n and "/" not in n and n not in (".", "..") for n in (manifest.work_area, manifest.weights))
        return manifest if names_ok and isinstance(manifest.workers, int) and manifest.workers > 0 else None


class SidecarWorkers:
    """The GPU worker's end: the workers a sidecar runs, found through the manifest. The sidecar starts them
    again when they die; a worker whose mark is older than STALE_S (the sidecar is gone) takes no jobs. The
    GPU worker serves without them until they are ready."""

    STALE_S = 2.0
    restarts = 0  # the sidecar counts its own

    _area: WorkArea  # the files `serve` named

    def __init__(self, count: int) -> None:
        assert count > 0, "one worker at least"
        self.count = count

    def serve(self, area: WorkArea, weights: Path, dtype: str) -> None:
        """Name the files in the manifest: the sidecar moves its workers to them."""
        self._area = area
        SidecarManifest(area.path.name, weights.name, dtype, self.count).write(area.path.parent)

    def wait_ready(self) -> None:
        """Nothing to wait for: the GPU worker serves without them until they answer."""

    def restart_exited(self) -> None:
        """The sidecar starts its own again."""

    def running(self, index: int) -> bool:
        return time.time() * 1e3 - int(self._area.control[index, BEAT]) < self.STALE_S * 1e3

    def ready(self, index: int) -> bool:
        return self.running(index) and int(self._area.control[index, PID]) != 0

    def kill(self, index: int) -> None:
        """Ask the sidecar to kill a stuck worker and wait (up to STALE_S) until it has: a worker still running
        must not write into a later job's rows. Until its replacement answers it takes no jobs."""
        control = self._area.control[index]
        control[PID] = 0
        asked = int(control[KILL]) + 1
        control[KILL] = asked
        deadline = time.monotonic() + self.STALE_S
        while int(control[KILLED]) < asked and time.monotonic() < deadline:
            time.sleep(1e-3)

    def stop(self) -> None:
        """The sidecar's workers outlive this process: a new GPU worker's manifest moves them to its files."""


def core_shares(cpus: list[int], workers: int, cores_each: int) -> list[tuple[int, ...]]:
    """`cores_each` of `cpus` for each worker; fewer each (one at least, shared in turn) when there are not
    that many."""
    each = max(1, min(cores_each, len(cpus) // workers))
    return [tuple(cpus[(w * each + k) % len(cpus)] for k in range(each)) for w in range(workers)]


class Sidecar:
    """The sidecar's end: `step` every BEAT_S. A new manifest (the GPU worker started again) moves the
    workers to its files."""

    def __init__(self, directory: Path, cores_each: int) -> None:
        self._directory, self._cores_each = directory, cores_each
        self._manifest: SidecarManifest | None = None
        self._area: WorkArea | None = None
        self._workers: CpuLoraSupervisor | None = None

    def step(self) -> None:
        """One look: follow a new manifest, serve kill requests, start the dead again, mark the living."""
        manifest = SidecarManifest.read(self._directory)
        if manifest != self._manifest:
            self._switch(manifest)
        if self._area is None or self._workers is None:
            return
        for index, control in enumerate(self._area.control):
            if int(control[KILL]) > int(control[KILLED]):
                self._workers.kill(index)
                log.warning("killed CPU LoRA worker %d, stuck on a job", index)
                control[KILLED] = control[KILL]
        self._workers.restart_exited()
        self._area.control[:, BEAT] = int(time.time() * 1e3)  # every one runs: the dead were just started again

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
        cores = core_shares(allowed_cpus(os.getpid()), manifest.workers, self._cores_each)
        self._manifest, self._area, self._workers = manifest, area, CpuLoraSupervisor(cores)
        self._workers.serve(area, self._directory / manifest.weights, manifest.dtype)
        log.info("serving %s with %d CPU LoRA workers on cores %s", manifest.work_area, manifest.workers, cores)

    def stop(self) -> None:
        if self._workers is not None:
            self._workers.stop()
        if self._area is not None:
            self._area.close()
        self._manifest, self._area, self._workers = None, None, None
