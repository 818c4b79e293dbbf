"""The base projections' matmul: out = x @ Wᵀ (+ bias).

Decode steps multiply a few rows by each weight matrix: the step streams the weights once and is
bound by memory bandwidth. For up to SKINNY_MAX_ROWS rows of a 16-bit model on CUDA, a Triton
kernel that splits only the output columns streams a 7B decode step's matmuls 7-11% faster than
cuBLAS, which splits K for some of them and reduces in a second kernel, and launches without
programmatic dependent launch (kernels/pdl.py). At 64 rows cuBLAS wins (gate_up), hence 32;
`benchmarks/linear_bench.py` measures both (docs/benchmarks/engine.md). Everything else goes to F.linear.

kernels.linear_with_lora is the base matmul plus a LoRA shrink and expand. Where the skinny kernel serves
the rows, it adds the expand's product in its own programs (kernels/triton_linear.py); `TESSERA_FUSE_LORA=0`
turns that off (for A/B timing), leaving the matmul and kernels.lora_expand one after the other.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

SKINNY_MAX_ROWS = 32
FUSE_LORA_ENV_VAR = "TESSERA_FUSE_LORA"


def skinny(x: torch.Tensor) -> bool:
    """Whether the Triton skinny matmul serves x's rows."""
    return x.is_cuda and x.shape[0] <= SKINNY_MAX_ROWS and x.dtype in (torch.float16, torch.bfloat16)


def fuse_lora() -> bool:
    return os.environ.get(FUSE_LORA_ENV_VAR, "1") != "0"


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [num_tokens, in_features], weight: [out_features, in_features] -> [num_tokens, out_features]."""
    if skinny(x):
        from kernels.triton_linear import skinny_linear  # triton only where CUDA is
        return skinny_linear(x, weight, bias)
    return F.linear(x, weight, bias)
