"""The kernels' API: the LoRA ops, the base projections' matmul, paged attention, the decoder
layer's fused elementwise ops and the all-layer merge. This module is the one place that chooses
each op's backend.

CUDA tensors go to the Triton kernels (kernels/triton/, graph-capturable, no host syncs; imported
on first GPU use: CPU-only installs have no triton), anything else to the torch references. Layers
call only these names and never branch on the platform. Each op's contract (dataclasses, shape
checks) and its reference live beside this module, and the Triton modules import them, never the
other way round: batch.py, adapter_arena.py, lora_stack.py and reference.py (LoRA), attention.py,
fused.py, merge.py. The LoRA kernels' tiles come from tiling.py's lookup in the tables that
`python -m kernels.tuner` writes (tables/).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from kernels import reference
from kernels.adapter_arena import AdapterArena
from kernels.attention import AttentionMetadata, paged_attention_reference
from kernels.batch import NO_SLOT, LoRABatch
from kernels.fused import (check_norm, check_rotary, fused_add_rms_norm_reference, rms_norm_reference,
                           rotary_store_kv_reference, silu_and_mul_reference)
from kernels.lora_stack import LoRAStack, upload_rows
from kernels.merge import MergeTarget, merge_weights_reference, restore_weights_reference

__all__ = ["NO_SLOT", "SKINNY_MAX_ROWS", "AdapterArena", "LoRABatch", "LoRAStack", "upload_rows", "fused_add_rms_norm", "linear",
           "lora_expand", "lora_shrink", "merge_weights", "paged_attention", "restore_weights", "rms_norm",
           "rotary_store_kv", "silu_and_mul", "warm_up_merge"]

# Decode steps multiply a few rows by each weight matrix: the step streams the weights once and is
# bound by memory bandwidth. For up to SKINNY_MAX_ROWS rows of a 16-bit model on CUDA, a Triton kernel
# that splits only the output columns (kernels/triton/linear.py) streams a 7B decode step's matmuls
# faster than cuBLAS, which splits K for some of them and reduces in a second kernel, and launches
# without programmatic dependent launch. At 64 rows cuBLAS wins (gate_up), hence 32;
# benchmarks/linear_bench.py measures both (docs/benchmarks/engine.md).
SKINNY_MAX_ROWS = 32


def lora_shrink(x: torch.Tensor, stack: LoRAStack, batch: LoRABatch) -> torch.Tensor:
    """x [num_tokens, in_features] -> y [splits, num_tokens, num_slices, batch.y_ranks(max_rank)], float32 or (one
    plane) x's dtype.

    y holds partial sums over in_features (splits >= 1 planes, which lora_expand adds up):
    y.sum(0)[t, s, :r] = scaling[slot, s] * x[t] @ A_sᵀ of the slot's adapter (rank r on slice s), for
    tokens of segments with a slot and slices of rank r > 0; in a mixture batch (kernels/batch.py), columns
    [r, r + r_mix) likewise of the mixture slot for segments of other slots; other entries are unspecified.
    """
    if x.is_cuda:
        from kernels.triton import lora_shrink as triton_shrink  # first GPU use: CPU-only installs have no triton
        return triton_shrink.lora_shrink(x, stack, batch)
    return reference.lora_shrink(x, stack, batch)


def lora_expand(out: torch.Tensor, y: torch.Tensor, stack: LoRAStack, batch: LoRABatch) -> None:
    """out [num_tokens, out_features] += y.sum(0)[t, s, :r] @ B_sᵀ [r, slice s columns] of the slot's
    adapter, in place.

    Accumulated in float32, for tokens of segments with a slot and slices of rank r > 0; other
    rows and columns of out are untouched.
    """
    if out.is_cuda:
        from kernels.triton import lora_expand as triton_expand
        triton_expand.lora_expand(out, y, stack, batch)
    else:
        reference.lora_expand(out, y, stack, batch)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [num_tokens, in_features], weight: [out_features, in_features] -> [num_tokens, out_features]."""
    # 0 rows: a step of prompt chunks that all end mid-prompt asks the head for no logits.
    if x.is_cuda and 0 < x.shape[0] <= SKINNY_MAX_ROWS and x.dtype in (torch.float16, torch.bfloat16):
        from kernels.triton.linear import skinny_linear
        return skinny_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float) -> torch.Tensor:
    """Causal attention of the packed new tokens over their sequences' cached K/V (kernels/attention.py).

    q:                [num_tokens, num_heads, head_dim]
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], this step's K/V already stored
    returns           [num_tokens, num_heads, head_dim] in q's dtype. Rows not covered by any sequence
                      (past query_start_loc[-1]) are zero on the reference and left unwritten by Triton.
    """
    if q.is_cuda:
        from kernels.triton.attention import paged_attention_triton
        return paged_attention_triton(q, k_cache, v_cache, meta, scale)
    return paged_attention_reference(q, k_cache, v_cache, meta, scale)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [num_tokens, hidden] -> weight * (x / rms(x)) [num_tokens, hidden] in x's dtype."""
    check_norm(x, weight)
    if x.is_cuda:
        from kernels.triton import fused as triton_fused
        out = torch.empty_like(x)
        triton_fused.add_rms_norm(x, None, weight, eps, out, None)
        return out
    return rms_norm_reference(x, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add of the previous sublayer fused into the next norm.

    x, residual: [num_tokens, hidden], same dtype
    returns      (rms_norm(x + residual), x + residual), new tensors; the sum is rounded to the
                 dtype before the norm reads it, as HF's `residual + hidden_states` is
    """
    check_norm(x, weight)
    assert residual.shape == x.shape and residual.dtype == x.dtype, (residual.shape, x.shape, residual.dtype)
    if x.is_cuda:
        from kernels.triton import fused as triton_fused
        out, residual_out = torch.empty_like(x), torch.empty_like(x)
        triton_fused.add_rms_norm(x, residual, weight, eps, out, residual_out)
        return out, residual_out
    return fused_add_rms_norm_reference(x, residual, weight, eps)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [num_tokens, 2 * inter] (gate columns, then up) -> silu(gate) * up [num_tokens, inter]."""
    assert gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0, gate_up.shape
    if gate_up.is_cuda:
        from kernels.triton import fused as triton_fused
        out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
        triton_fused.silu_and_mul(gate_up, out)
        return out
    return silu_and_mul_reference(gate_up)


def rotary_store_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int,
                    head_dim: int) -> torch.Tensor:
    """Rotary on q and k (neox style, HF's rotate_half) and this step's K/V into the paged caches.

    qkv:              [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim], the fused projection's
                      output: q heads, then k heads, then v heads
    cos, sin:         [num_tokens, head_dim] in qkv's dtype, computed once per step from the positions
                      (gpu_worker.layers.rotary.RotaryEmbedding)
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]; token t's rotated k and its v go
                      to flat slot slot_mapping[t] (int64), as kernels.attention.store_kv writes them
    returns           q with rotary applied, [num_tokens, num_heads, head_dim], contiguous
    """
    check_rotary(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads, head_dim)
    if qkv.is_cuda:
        from kernels.triton import fused as triton_fused
        q = qkv.new_empty(qkv.shape[0], num_heads, head_dim)
        triton_fused.rotary_store_kv(qkv, cos, sin, k_cache, v_cache, slot_mapping, q)
        return q
    return rotary_store_kv_reference(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads,
                                     head_dim)


def merge_weights(targets: Sequence[MergeTarget], slot: int) -> None:
    """backup <- W, then W[slice rows] += scaling * B @ A for each slice the slot's adapter targets
    (kernels/merge.py)."""
    if targets and targets[0].weight.is_cuda:
        from kernels.triton.merge import merge_weights_triton
        merge_weights_triton(targets, slot)
    else:
        merge_weights_reference(targets, slot)


def restore_weights(targets: Sequence[MergeTarget]) -> None:
    """W <- backup for every target (bit-exact)."""
    if targets and targets[0].weight.is_cuda:
        from kernels.triton.merge import restore_weights_triton
        restore_weights_triton(targets)
    else:
        restore_weights_reference(targets)


def warm_up_merge(targets: Sequence[MergeTarget]) -> None:
    """Compile (CUDA) the merge and restore kernels `targets` select, launching nothing, so that the
    first merge of a worker does not wait on a compile. Backups are not read: a weight may stand in
    for its own."""
    if targets and targets[0].weight.is_cuda:
        from kernels.triton.merge import merge_weights_triton, restore_weights_triton
        merge_weights_triton(targets, 0, compile_only=True)
        restore_weights_triton(targets, compile_only=True)
