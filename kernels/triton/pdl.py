"""Programmatic dependent launch (PDL, Hopper and newer) for the engine step's Triton kernels.

Without it, a kernel is launched only after the kernel before it has fully finished: in a decode
step of ~400-500 small launches (CUDA graph replay), each boundary leaves the GPU idle while the
next grid is set up. A kernel launched with PDL is set up while the kernel before it drains; its
programs then wait at `wait_for_inputs` until that kernel has finished and its writes are visible.

Most kernels here wait first thing: nothing is read earlier, and the gain is the launch latency.
The LoRA kernels (lora_shrink.py, lora_expand.py) first read what no kernel of a step writes (the batch
metadata, copied in before the step, the adapter's rank and, for small tiles, its first A or B
tile), then wait, then read their activations. They also let their dependents launch early
(`start_dependents`, once a program has done its loads): the expand a shrink feeds, or the next
expand, runs its own prologue while the kernel before it finishes. That is safe because a kernel
starts its dependents only after its own wait: whatever ran two kernels back has completed, and
only the immediate predecessor's writes are unseen before the wait, which the prologue never
reads. It made both LoRA ops faster at every token count measured (docs/benchmarks/kernels.md).

The other kernels do not start their dependents early: starting them at every kernel's start made
back-to-back skinny matmuls and the decode step slower, and starting them after the matmul's K
loop did not pay either (docs/benchmarks/kernels.md and engine.md, PDL sections).

Every program executes the wait before it exits, early exits included: a kernel must not
finish before its predecessor, or the kernel after it could run ahead of that predecessor's writes.

`TESSERA_PDL=0` turns it off (for A/B timing); off the GPU and before sm_90 it is always off.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

ENV_VAR = "TESSERA_PDL"


@functools.cache
def _supported(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


def enabled(device: torch.device) -> bool:
    if device.type != "cuda" or os.environ.get(ENV_VAR, "1") == "0":
        return False
    return _supported(torch.cuda.current_device() if device.index is None else device.index)


def launch_options(device: torch.device) -> dict[str, bool]:
    """Keyword arguments for launching (or warming up) a kernel that calls `wait_for_inputs`: its
    PDL constexpr and Triton's launch_pdl flag, on or off together."""
    on = enabled(device)
    return {"PDL": on, "launch_pdl": on}


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """Wait until the previous kernel has finished and its writes are visible. A no-op when PDL is off."""
    if PDL:
        gdc_wait()


@triton.jit
def start_dependents(PDL: tl.constexpr):
    """Let the next kernel launch (and run up to its wait) once every program got here."""
    if PDL:
        gdc_launch_dependents()
