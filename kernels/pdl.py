"""Programmatic dependent launch (PDL, Hopper and newer) for every Triton kernel of the engine.

Without it, a kernel's programs start only after the kernel before it has fully finished: in a
decode step of ~400-500 small launches (CUDA graph replay), each boundary leaves the GPU idle while
the next grid is set up and scheduled. A kernel launched with PDL may be scheduled as soon as
every program of the kernel before it has started; its programs then wait at `wait_for_inputs`,
the first statement of every kernel here, until that kernel has finished and its writes are
visible. Nothing is read earlier, so the results are exactly those of serialized launches: the
gain is the launch latency, hidden behind the previous kernel's last wave.

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
    """Keyword arguments for launching (or warming up) a kernel that begins with `wait_for_inputs`:
    its PDL constexpr and Triton's launch_pdl flag, on or off together."""
    on = enabled(device)
    return {"PDL": on, "launch_pdl": on}


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """Wait until the previous kernel has finished (its writes visible), then let the next kernel be
    scheduled. A no-op when PDL is off."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
