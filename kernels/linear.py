"""The base projections' matmul: out = x @ Wᵀ (+ bias).

Decode steps multiply a few rows by each weight matrix: the step streams the weights once and is
bound by memory bandwidth. For up to SKINNY_MAX_ROWS rows of a 16-bit model on CUDA, a Triton
kernel that splits only the output columns streams a 7B decode step's matmuls 7-11% faster than
cuBLAS, which splits K for some of them and reduces in a second kernel, and launches without
programmatic dependent launch (kernels/pdl.py). At 64 rows cuBLAS wins (gate_up), hence 32;
`benchmarks/linear_bench.py` measures both (docs/benchmarks/engine.md). Everything else goes to F.linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SKINNY_MAX_ROWS = 32


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [num_tokens, in_features], weight: [out_features, in_features] -> [num_tokens, out_features]."""
    # 0 rows: a step of prompt chunks that all end mid-prompt asks the head for no logits.
    if x.is_cuda and 0 < x.shape[0] <= SKINNY_MAX_ROWS and x.dtype in (torch.float16, torch.bfloat16):
        from kernels.triton_linear import skinny_linear  # triton only where CUDA is
        return skinny_linear(x, weight, bias)
    return F.linear(x, weight, bias)
