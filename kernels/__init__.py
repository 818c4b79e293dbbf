"""LoRA ops (and the base projections' matmul) behind one API; this module is the one place that
chooses the LoRA ops' backend.

CUDA tensors go to the Triton kernels (graph-capturable, no host syncs), anything else to the
torch reference. Layers call only these names and never branch on the platform.
"""

from __future__ import annotations

import torch

from kernels import reference
from kernels.batch import NO_SLOT, LoRABatch
from kernels.linear import linear
from kernels.lora_stack import LoRAStack

__all__ = ["NO_SLOT", "LoRABatch", "LoRAStack", "linear", "lora_expand", "lora_shrink"]


def lora_shrink(x: torch.Tensor, stack: LoRAStack, batch: LoRABatch) -> torch.Tensor:
    """x [num_tokens, in_features] -> y [splits, num_tokens, num_slices, max_rank], float32 or (one plane) x's dtype.

    y holds partial sums over in_features (splits >= 1 planes, which lora_expand adds up):
    y.sum(0)[t, s, :r] = scaling[slot] * x[t] @ A[slot, s, :r]ᵀ for tokens of segments with a slot
    and slices of rank r > 0; other entries are unspecified.
    """
    if x.is_cuda:
        from kernels import triton_lora  # imported on first GPU use: CPU-only installs have no triton
        return triton_lora.lora_shrink(x, stack, batch)
    return reference.lora_shrink(x, stack, batch)


def lora_expand(out: torch.Tensor, y: torch.Tensor, stack: LoRAStack, batch: LoRABatch) -> None:
    """out [num_tokens, out_features] += y.sum(0)[t, s, :r] @ stack.b[slot, :r, slice s columns], in place.

    Accumulated in float32, for tokens of segments with a slot and slices of rank r > 0; other
    rows and columns of out are untouched.
    """
    if out.is_cuda:
        from kernels import triton_lora
        triton_lora.lora_expand(out, y, stack, batch)
    else:
        reference.lora_expand(out, y, stack, batch)
