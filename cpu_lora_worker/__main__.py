"""`python -m cpu_lora_worker --work-area PATH --weights PATH --index I [--cores 2-3] [--dtype bfloat16]
[--parent PID]`:
one CPU LoRA worker, pinned to `--cores` (cores of the GPU's NUMA node, or a sidecar's share of its own:
services/common/cpu_lora/supervisor.py starts it), serving the work area of its GPU worker until SIGTERM
or until the process that started it (`--parent`) is gone (killed, it could not stop its children: they
would spin on for nothing)."""

from __future__ import annotations

import argparse
import logging
import mmap
import os
import signal
import warnings
from pathlib import Path

import numpy as np
import torch

from cpu_lora_worker.worker import serve
from services.common.cpu_lora.numa import parse_cpulist
from services.common.cpu_lora.shm import WorkArea

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def map_weights(path: Path, dtype: torch.dtype) -> torch.Tensor:
    """The weights region (the GPU worker's host tier) as a flat tensor, mapped shared and read-only:
    every process reads the one copy in memory, sees adapters written into it later, and cannot
    change it (a write would fault)."""
    with path.open("rb") as f:
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    with warnings.catch_warnings():  # torch warns that the array is not writable: that is the point
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.frombuffer(mapping, dtype=np.uint8)).view(dtype)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--work-area", type=Path, required=True)
    parser.add_argument("--weights", type=Path, required=True)
    parser.add_argument("--index", type=int, required=True, help="this worker's control block")
    parser.add_argument("--cores", help="CPU list to pin to, as the kernel writes it (2-3,6)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="the weights region's dtype")
    parser.add_argument("--parent", type=int, help="exit once this process is no longer the parent")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s cpu-lora[%(process)d] %(levelname)s %(message)s")
    if args.cores:
        cores = parse_cpulist(args.cores)
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(len(cores))
    stop: list[bool] = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    area = WorkArea.open(args.work_area)
    if not 0 <= args.index < area.shape.workers:
        parser.error(f"--index {args.index}: the work area has {area.shape.workers} workers")
    serve(area, args.index, map_weights(args.weights, DTYPES[args.dtype]),  # an orphan is adopted by another process
          lambda: bool(stop) or (args.parent is not None and os.getppid() != args.parent))


if __name__ == "__main__":
    main()
