"""Triton LoRA shrink (ATMM), behind the contract of kernels/reference.py's lora_shrink.

One program per (M-tile of a group, rank block x slice x K-split); how a program finds its M-tile,
and what makes the op graph-capturable, is in kernels/triton/lora_common.py.

Shrink may split K over `split_k` programs; each stores its partial product in its own plane of
y ([split_k, tokens, slices, ranks], float32) and expand sums the planes in the same load that reads
y. That needs no zero-filled y (a memset node per call in a graph) and no atomics (results are
deterministic), and it is what keeps decode shrinks, whose few tiles would leave most SMs idle,
short (figures: docs/benchmarks/kernels.md). The price is paid in expand, every program of which
loads split_k [BLOCK_M, BLOCK_R] tiles: many planes of a wide rank tile cost expand more than the
split saves, so kernels/tiling.py caps the product (PLANE_TILE_CAP). An unsplit shrink writes its
one plane in x's dtype (`y_dtype`): the expand's tensor-core tiles round y to it anyway, and half
the bytes matter to B-stationary expands, which re-read y for every column tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import tiling
from kernels.adapter_arena import ALIGN
from kernels.batch import LoRABatch
from kernels.lora_stack import LoRAStack
from kernels.tiling import ShrinkConfig
from kernels.triton import pdl
from kernels.triton.compile_ahead import launcher
from kernels.triton.lora_common import (PER_STEP, dot_precision, find_tile, group_block, is_pow2, m_tile_bound,
                                        matmul, one_tile_per_group, rank_tile, rows_arg)


def y_dtype(split_k: int, dtype: torch.dtype) -> torch.dtype:
    """The dtype of the y lora_shrink returns: float32 partial sums when K is split, else the model's."""
    return torch.float32 if split_k > 1 else dtype


def lora_shrink(x: torch.Tensor, stack: LoRAStack, batch: LoRABatch,
                config: ShrinkConfig | None = None, compile_only: bool = False) -> torch.Tensor:
    """y.sum(0)[t, s, :r] = scaling[slot, s] * x[t] @ A_sᵀ of the slot's adapter (rank r on slice s) for
    tokens of groups using a slot, and zeros past r up to the batch's rank tile (`rank_tile`); other
    entries are unspecified.

    x:      [num_tokens, in_features], the arena's dtype
    returns y: [split_k, num_tokens, num_slices, max_rank] (`y_dtype`), one partial sum over K a plane
    compile_only: compile the kernel for these arguments without launching it (kernels.tuner)
    """
    stack.check_shrink_args(x, batch)
    assert x.dtype == stack.dtype, (x.dtype, stack.dtype)
    cfg = config or tiling.shrink_config(stack, batch)
    assert cfg.block_m >= 1 and cfg.block_k >= 16 and is_pow2(cfg.split_k), cfg  # expand: tl.arange(split_k)
    y = torch.empty(cfg.split_k, batch.num_tokens, stack.num_slices, batch.y_ranks(stack.max_rank),
                    dtype=y_dtype(cfg.split_k, x.dtype), device=x.device)
    if batch.num_tokens == 0 or batch.capacity == 0:
        return y
    # K range of one split, a multiple of block_k; trailing splits may get an empty range.
    k_per_split = triton.cdiv(triton.cdiv(stack.in_features, cfg.split_k), cfg.block_k) * cfg.block_k
    block_r = rank_tile(stack, batch)
    rank_block = min(cfg.rank_block or block_r, block_r)
    assert is_pow2(rank_block) and (cfg.block_m < 16 or rank_block >= 16), cfg  # tl.dot: N >= 16
    grid = (m_tile_bound(batch, cfg.block_m), stack.num_slices * cfg.split_k * (block_r // rank_block))
    launcher(_shrink_kernel, grid, compile_only)(
        x, stack.arena.data, y, stack.a_offsets, stack.ranks, stack.scalings, batch.starts, batch.lens, batch.slots,
        rows_arg(x, batch), batch.capacity, stack.in_features, stack.num_slices, cfg.split_k, k_per_split,
        y.shape[-1], batch.mix_slot,
        x.stride(0), x.stride(1),
        *y.stride(),
        BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k, BLOCK_R=rank_block,
        GROUP_BLOCK=group_block(batch.capacity), ONE_TILE=one_tile_per_group(batch, cfg.block_m),
        GATHER=batch.rows is not None, DOT_PRECISION=dot_precision(x.dtype), ONE_STEP=k_per_split == cfg.block_k,
        MIX=batch.is_mixture, ARENA_ALIGN=ALIGN, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.launch_options(x.device),
    )
    return y


@triton.jit(**PER_STEP)
def _shrink_kernel(
    x_ptr, arena_ptr, y_ptr, a_offsets_ptr, ranks_ptr, scalings_ptr, starts_ptr, lens_ptr, slots_ptr, rows_ptr,
    num_groups, in_features, num_slices, split_k, k_per_split, y_ranks, mix_slot,
    stride_xm, stride_xk,
    stride_y_split, stride_ym, stride_y_slice, stride_y_rank,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    GROUP_BLOCK: tl.constexpr, ONE_TILE: tl.constexpr, GATHER: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ONE_STEP: tl.constexpr, MIX: tl.constexpr, ARENA_ALIGN: tl.constexpr, PDL: tl.constexpr,
):
    # Before the wait: what no kernel of the step writes (batch metadata, the slot's tables, A), so that
    # it is in flight while the previous kernel drains. x comes after it.
    # grid: (M-tile, (rank block * slices + slice) * split_k + split); BLOCK_R ranks a program
    slot, rows, m_mask = find_tile(starts_ptr, lens_ptr, slots_ptr, rows_ptr, num_groups,
                                   BLOCK_M, GROUP_BLOCK, ONE_TILE, GATHER)
    pid = tl.program_id(1)
    split = pid % split_k
    slice_idx = (pid // split_k) % num_slices
    r_begin = (pid // (split_k * num_slices)) * BLOCK_R
    # The slot's rank and A_s offset on this slice, loaded together (one round trip); rank 0 for the
    # grid's slack past the last tile, an empty slot or an untargeted slice.
    entry = slot * num_slices + slice_idx
    rank = tl.load(ranks_ptr + entry, mask=slot >= 0, other=0)
    a_offset = tl.multiple_of(tl.load(a_offsets_ptr + entry, mask=slot >= 0, other=0), ARENA_ALIGN)
    k_begin = split * k_per_split
    offs_r = r_begin + tl.arange(0, BLOCK_R)
    offs_k = k_begin + tl.arange(0, BLOCK_K)
    # A_s [rank, in_features], rows contiguous: a [BLOCK_K, BLOCK_R] tile of A_sᵀ
    if MIX:  # ranks past the slot's own are the mixture slot's (kernels/batch.py), for groups of other slots
        mix_entry = mix_slot * num_slices + slice_idx
        mix_rank = tl.where((slot >= 0) & (slot != mix_slot), tl.load(ranks_ptr + mix_entry), 0)
        a_rows = tl.where(offs_r < rank, a_offset + offs_r * in_features,
                          tl.load(a_offsets_ptr + mix_entry) + (offs_r - rank) * in_features)
        a_ptrs = arena_ptr + a_rows[None, :] + offs_k[:, None]
        own_rank = rank
        rank += mix_rank
    else:
        a_ptrs = arena_ptr + a_offset + offs_r[None, :] * in_features + offs_k[:, None]
    r_mask = offs_r < rank  # the slice's true rank: rows past it are another block's or another adapter's
    # k_per_split is a multiple of BLOCK_K: only in_features masks K.
    if ONE_STEP:  # a split's K range is one step: its whole A tile is read before the wait
        a = tl.load(a_ptrs, mask=r_mask[None, :] & (offs_k < in_features)[:, None], other=0.0)
    pdl.wait_for_inputs(PDL)
    # y's columns of this rank block (y_ranks: a host int, so stores stay vectorized); past the adapter's
    # rank they get zeros (its A rows are masked), which B-stationary expands read unmasked.
    y_ptrs = (y_ptr + split * stride_y_split + rows[:, None] * stride_ym + slice_idx * stride_y_slice
              + offs_r[None, :] * stride_y_rank)
    y_mask = m_mask[:, None] & (offs_r < y_ranks)[None, :]
    if rank == 0:  # no tile, or an untargeted slice
        return
    if r_begin >= rank:  # ranks past this adapter's own
        tl.store(y_ptrs, tl.zeros((BLOCK_M, BLOCK_R), dtype=y_ptr.dtype.element_ty), mask=y_mask)
        return
    scaling = tl.load(scalings_ptr + entry)
    if MIX:  # a scaling per column: the slot's, then the mixture slot's
        scaling = tl.where(offs_r < own_rank, scaling, tl.load(scalings_ptr + mix_entry))[None, :]
    x_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk  # [BLOCK_M, BLOCK_K]
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    if ONE_STEP:
        x = tl.load(x_ptrs, mask=m_mask[:, None] & (offs_k < in_features)[None, :], other=0.0)
        acc = matmul(x, a, acc, BLOCK_M, DOT_PRECISION)
    else:
        for k in range(0, k_per_split, BLOCK_K):
            k_mask = offs_k + k < in_features
            x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            a = tl.load(a_ptrs, mask=r_mask[None, :] & k_mask[:, None], other=0.0)
            acc = matmul(x, a, acc, BLOCK_M, DOT_PRECISION)
            x_ptrs += BLOCK_K * stride_xk
            a_ptrs += BLOCK_K
    pdl.start_dependents(PDL)
    # Every split stores its plane, an empty K range too (zeros): expand sums all planes.
    tl.store(y_ptrs, (acc * scaling).to(y_ptr.dtype.element_ty), mask=y_mask)
