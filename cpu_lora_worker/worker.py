"""A CPU LoRA worker's loop: wait for its request counter to move, compute its share, answer."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import torch

from services.common.cpu_lora.delta import lora_delta
from services.common.cpu_lora.shm import (DONE, PID, RATE_RANKS, RATES, REQUEST, STATUS, STATUS_FAILED, STATUS_OK,
                                       WorkArea)

log = logging.getLogger(__name__)

SPIN_S = 200e-6   # poll without sleeping this long after each answer: the next layer's job comes soon
MAX_PAUSE_S = 1e-3


def measure_rates(in_features: int, out_features: int, tokens: int = 256) -> list[int]:
    """Tokens per second one core computes a LoRA delta at each of RATE_RANKS (the GPU worker sizes
    each cold request's share of cores by these)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x = torch.randn(tokens, in_features)
        rates = []
        for rank in RATE_RANKS:
            a, bt = torch.randn(rank, in_features), torch.randn(rank, out_features)
            (x @ a.t()) @ bt  # warm-up
            started, repeats = time.perf_counter(), 3
            for _ in range(repeats):
                (x @ a.t()) @ bt
            rates.append(int(repeats * tokens / (time.perf_counter() - started)))
        return rates
    finally:
        torch.set_num_threads(threads)


def serve(area: WorkArea, index: int, weights: torch.Tensor, stopping: Callable[[], bool]) -> None:
    """Answer the jobs posted for worker `index` until `stopping()`."""
    control = area.control[index]
    control[RATES:RATES + len(RATE_RANKS)] = measure_rates(area.shape.max_in, area.shape.max_out)
    control[STATUS] = STATUS_OK
    answered = int(control[REQUEST])
    control[DONE] = answered
    control[PID] = os.getpid()  # last: the GPU worker counts this worker in once it sees its pid
    idle_since, pause = time.monotonic(), 0.0
    while not stopping():
        request = int(control[REQUEST])
        if request == answered:
            if time.monotonic() - idle_since > SPIN_S:
                time.sleep(pause)
                pause = min(MAX_PAUSE_S, pause * 2 or 1e-5)
            continue
        try:
            lora_delta(area.read_job(index), area.y, weights)
            control[STATUS] = STATUS_OK
        except Exception:  # noqa: BLE001 - a bad job fails that job, not the worker
            log.exception("CPU LoRA job %d failed", request)
            control[STATUS] = STATUS_FAILED
        control[DONE] = answered = request
        idle_since, pause = time.monotonic(), 0.0
