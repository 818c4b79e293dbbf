"""Triton kernels of the fused ops (kernels/fused.py): one launch per op, one program per token row
(or row tile).

Each wrapper writes into outputs its caller allocated (kernels/__init__.py allocates them; the
tests hand in NaN-filled ones to prove every element is written). Grids come from tensor shapes
only and no wrapper reads a device value: CUDA-graph capturable.

Numerics repeat eager HF's roundings: every product or sum that eager torch rounds to the model's
dtype is computed in float32 and rounded here too (`.to(dtype)` between steps), so bf16 results
agree with the torch references in kernels.fused.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton import pdl

# GPU-tuning knobs (untuned defaults, sized for hidden 4096-8192 / intermediate 11008-14336 / head_dim 128).
NORM_ELEMENTS_PER_WARP = 512   # a norm row of H elements gets H / 512 warps (1..16): ~16 floats per thread
SILU_BLOCK = 1024              # output columns per program of silu_and_mul
ROTARY_ELEMENTS = 1024         # q/k elements per rotary program: 1024 // head_dim heads of one token
NUM_WARPS = 4                  # silu_and_mul and rotary_store_kv


@triton.jit
def _add_rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
                         x_stride, residual_stride, out_stride, residual_out_stride, hidden, eps,
                         HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """One token row: [residual_out = x + residual;] out = weight * (x / rms(x)), rounded as HF."""
    pdl.wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * residual_stride + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(dtype)  # the sum the norm reads is in the dtype
        tl.store(residual_out_ptr + row * residual_out_stride + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    mean_square = tl.sum(x32 * x32, axis=0) / hidden  # masked columns loaded as 0 add nothing
    normed = (x32 * tl.math.rsqrt(mean_square + eps)).to(dtype)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * out_stride + cols, (weight.to(tl.float32) * normed.to(tl.float32)).to(dtype),
             mask=mask)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 out: torch.Tensor, residual_out: torch.Tensor | None) -> None:
    """out = rms_norm(x [+ residual]); residual_out = x + residual when residual is given.

    x, residual, out, residual_out: [num_tokens, hidden], rows of unit column stride
    weight:                         [hidden]
    """
    assert (residual is None) == (residual_out is None)
    rows = [x, out] + ([residual, residual_out] if residual is not None else [])
    assert all(t.shape == x.shape and t.dtype == x.dtype and t.stride(1) == 1 for t in rows), [t.shape for t in rows]
    assert weight.is_contiguous() and weight.shape == (x.shape[1],)
    hidden = x.shape[1]
    block = triton.next_power_of_2(hidden)
    has_residual = residual is not None
    _add_rms_norm_kernel[(x.shape[0],)](
        x, residual if has_residual else x, weight, out, residual_out if has_residual else out,
        x.stride(0), residual.stride(0) if has_residual else 0, out.stride(0),
        residual_out.stride(0) if has_residual else 0, hidden, eps,
        HAS_RESIDUAL=has_residual, BLOCK=block,
        num_warps=min(max(block // NORM_ELEMENTS_PER_WARP, 1), 16), **pdl.launch_options(x.device))


@triton.jit
def _silu_and_mul_kernel(gate_up_ptr, out_ptr, gate_up_stride, out_stride, inter, BLOCK: tl.constexpr,
                         PDL: tl.constexpr):
    """Columns [BLOCK * pid1, + BLOCK) of one token row: silu(gate) rounded to the dtype (F.silu),
    then times up, rounded again."""
    pdl.wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(gate_up_ptr + row * gate_up_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * gate_up_stride + inter + cols, mask=mask, other=0.0)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype)
    tl.store(out_ptr + row * out_stride + cols, (act.to(tl.float32) * up.to(tl.float32)).to(dtype), mask=mask)


def silu_and_mul(gate_up: torch.Tensor, out: torch.Tensor) -> None:
    """gate_up: [num_tokens, 2 * inter] -> out [num_tokens, inter] (both of unit column stride)."""
    num_tokens, inter = out.shape
    assert gate_up.shape == (num_tokens, 2 * inter) and gate_up.dtype == out.dtype, (gate_up.shape, out.shape)
    assert gate_up.stride(1) == 1 and out.stride(1) == 1
    grid = (num_tokens, triton.cdiv(inter, SILU_BLOCK))
    _silu_and_mul_kernel[grid](gate_up, out, gate_up.stride(0), out.stride(0), inter,
                               BLOCK=SILU_BLOCK, num_warps=NUM_WARPS, **pdl.launch_options(out.device))


@triton.jit
def _rotary_store_kv_kernel(qkv_ptr, cos_ptr, sin_ptr, slot_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
                            qkv_stride, cos_stride, sin_stride, num_heads, num_kv_heads,
                            HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    """Token t, heads [BLOCK_H * pid1, + BLOCK_H) of the rotating heads: q heads 0..num_heads-1, then
    k heads. A q head is rotated into q; a k head is rotated into k_cache at slot_mapping[t] and its
    v head (num_kv_heads heads further along the qkv row) copied to v_cache at the same slot.

    Each head is handled as two halves x1 = x[:HALF], x2 = x[HALF:]; rotate_half(x) = [-x2, x1], so
    out1 = x1 * cos1 - x2 * sin1 and out2 = x2 * cos2 + x1 * sin2, each product rounded to the dtype
    as eager HF rounds `x * cos` and `rotate_half(x) * sin` (negation commutes with rounding). The
    launch turns FMA contraction off: on sm_90 LLVM would otherwise fuse a rounded bf16 product into
    the following add (fma.rn.bf16), dropping that rounding; with it off the PTX is mul.rn.bf16 then
    add/sub.rn.bf16, bit-equal to eager torch.
    """
    pdl.wait_for_inputs(PDL)
    HALF: tl.constexpr = HEAD_DIM // 2
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    d = tl.arange(0, HALF)                                     # [HALF]
    dtype = q_ptr.dtype.element_ty
    rotating = heads < num_heads + num_kv_heads
    is_q = heads < num_heads
    is_k = rotating & (heads >= num_heads)

    src = qkv_ptr + t * qkv_stride + heads[:, None] * HEAD_DIM + d[None, :]  # [BLOCK_H, HALF] first halves
    x1 = tl.load(src, mask=rotating[:, None], other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=rotating[:, None], other=0.0).to(tl.float32)
    cos1 = tl.load(cos_ptr + t * cos_stride + d).to(tl.float32)[None, :]
    cos2 = tl.load(cos_ptr + t * cos_stride + HALF + d).to(tl.float32)[None, :]
    sin1 = tl.load(sin_ptr + t * sin_stride + d).to(tl.float32)[None, :]
    sin2 = tl.load(sin_ptr + t * sin_stride + HALF + d).to(tl.float32)[None, :]
    out1 = ((x1 * cos1).to(dtype).to(tl.float32) - (x2 * sin1).to(dtype).to(tl.float32)).to(dtype)
    out2 = ((x2 * cos2).to(dtype).to(tl.float32) + (x1 * sin2).to(dtype).to(tl.float32)).to(dtype)

    q_dst = q_ptr + (t * num_heads + heads[:, None]) * HEAD_DIM + d[None, :]
    tl.store(q_dst, out1, mask=is_q[:, None])
    tl.store(q_dst + HALF, out2, mask=is_q[:, None])

    slot = tl.load(slot_ptr + t)  # int64: flat cache row block * block_size + offset
    cache_offsets = (slot * num_kv_heads + (heads - num_heads)[:, None]) * HEAD_DIM + d[None, :]
    tl.store(k_cache_ptr + cache_offsets, out1, mask=is_k[:, None])
    tl.store(k_cache_ptr + cache_offsets + HALF, out2, mask=is_k[:, None])
    v_src = src + num_kv_heads * HEAD_DIM
    tl.store(v_cache_ptr + cache_offsets, tl.load(v_src, mask=is_k[:, None]), mask=is_k[:, None])
    tl.store(v_cache_ptr + cache_offsets + HALF, tl.load(v_src + HALF, mask=is_k[:, None]), mask=is_k[:, None])


def rotary_store_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, slot_mapping: torch.Tensor, q: torch.Tensor) -> None:
    """Shapes as kernels.rotary_store_kv; q: [num_tokens, num_heads, head_dim] contiguous, written."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    assert q.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert qkv.stride(1) == 1 and cos.stride(1) == 1 and sin.stride(1) == 1 and slot_mapping.is_contiguous()
    assert head_dim >= 16 and head_dim & (head_dim - 1) == 0, f"head_dim {head_dim} must be a power of two >= 16"
    rotating = num_heads + num_kv_heads
    block_h = min(max(ROTARY_ELEMENTS // head_dim, 1), triton.next_power_of_2(rotating))
    grid = (num_tokens, triton.cdiv(rotating, block_h))
    _rotary_store_kv_kernel[grid](qkv, cos, sin, slot_mapping, q, k_cache, v_cache,
                                  qkv.stride(0), cos.stride(0), sin.stride(0), num_heads, num_kv_heads,
                                  HEAD_DIM=head_dim, BLOCK_H=block_h, num_warps=NUM_WARPS,
                                  enable_fp_fusion=False, **pdl.launch_options(q.device))
