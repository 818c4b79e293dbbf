"""Programmatic dependent launch (PDL, Hopper and newer) for the engine step's Triton kernels.

Without it, a kernel is launched only after the kernel before it has fully finished: in a decode
step of ~400-500 small launches (CUDA graph replay), each boundary leaves the GPU idle while the
next grid is set up. A kernel launched with PDL is set up while the kernel before it drains; its
programs then wait at `wait_for_inputs`, the first statement of every kernel here, until that
kernel has finished and its writes are visible. Nothing is read earlier, so results are exactly
those of serialized launches: the gain is the launch latency.

The kernels do not also signal their dependents early (griddepcontrol.launch_dependents at their
start): on an H200 that made back-to-back skinny matmuls 10-28% slower and the batch-32 decode
step 0.5 ms slower, while waiting alone never lost (docs/benchmarks/engine.md, PDL section).

Every program executes the wait before anything else, early exits included: a kernel must not
finish before its predecessor, or the kernel after it could run ahead of that predecessor's writes.

`TESSERA_PDL=0` turns it off (for A/B timing); off the GPU and before sm_90 it is always off.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

ENV_VAR = "TESSERA_PDL"


@functools.cache
def _supported(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


def enabled(device: torch.device) -> bool:
    if device.type != "cuda" or os.environ.get(ENV_VAR, "1") == "0":
        return False
    return _supported(torch.cuda.current_device() if device.index is None else device.index)


def launch_options(device: torch.device) -> dict[str, bool]:
    """Keyword arguments for launching (or warming up) a kernel that begins with `wait_for_inputs`:
    its PDL constexpr and Triton's launch_pdl flag, on or off together."""
    on = enabled(device)
    return {"PDL": on, "launch_pdl": on}


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """Wait until the previous kernel has finished and its writes are visible. A no-op when PDL is off."""
    if PDL:
        gdc_wait()
