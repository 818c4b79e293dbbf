"""Names a worker kind (device × base model): the key of its performance model.

The profiler writes `policy/perf_models/<kind>.json`, the worker reports `<kind>` in its pushed
state, and the gateway prices the worker's steps with that model:
  cpu + tessera-demo-llama                    -> cpu-tessera-demo-llama
  "NVIDIA H100 80GB HBM3" + tessera-demo-llama -> nvidia-h100-80gb-hbm3-tessera-demo-llama
"""

from __future__ import annotations

import re

import torch


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def perf_model_kind(device: str, base_model: str) -> str:
    """`device` is a `device_name`; the kind is lowercase with runs of other characters as '-'."""
    return re.sub(r"[^a-z0-9.]+", "-", f"{device}-{base_model}".lower()).strip("-")
