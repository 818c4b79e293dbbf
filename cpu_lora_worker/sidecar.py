"""`tessera serve cpu-lora`: a GPU worker's CPU LoRA workers, run from another container of its pod (Kubernetes:
a sidecar mounting the same memory volume at worker.cpu_lora_shm_dir; the worker has
worker.cpu_lora_launch: sidecar). What the sidecar does, and how it and the GPU worker agree, is
services/common/cpu_lora/sidecar.py's; this is the command: its settings, its signals, its loop.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from pathlib import Path

from services.common.config import ConfigError, TesseraConfig
from services.common.cpu_lora.numa import allowed_cpus, format_cpulist
from services.common.cpu_lora.sidecar import BEAT_S, Sidecar

log = logging.getLogger(__name__)


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
