"""What the hardware gives, for the adapter tiers' rates to be compared with: a copy from page-locked
host memory to the device, and a plain read of files (benchmarks/cold_start_bench.py)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Wall-clock seconds of `fn`, the device's queued work finished before and after."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def copy_seconds(nbytes: int, device: torch.device, repeats: int) -> float:
    """Median seconds of copying `nbytes` from page-locked host memory to the device (on a CPU: a memcpy)."""
    cuda = device.type == "cuda"
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=cuda)  # warm-up
    return statistics.median(timed(lambda: dst.copy_(src, non_blocking=cuda), device) for _ in range(repeats + 2))


def read_seconds(paths: tuple[Path, ...]) -> float:
    """Seconds of a plain read of `paths`, whole, as the loader reads them."""
    started = time.perf_counter()
    for path in paths:
        path.read_bytes()
    return time.perf_counter() - started
