"""Triton LoRA expand (ATMM), behind the contract of kernels/reference.py's lora_expand.

One program per (M-tile of a group, N-tile of out's columns); how a program finds its M-tile, and
what makes the op graph-capturable, is in kernels/triton/lora_common.py. y comes from
kernels/triton/lora_shrink.py: `split` planes of partial sums over K, which every program adds up
as it loads them.

Programs come in three kinds. Two walk column steps over one M-tile (ExpandConfig.pipeline):
each next out tile loaded one step ahead into registers, or a loop the compiler pipelines through
shared memory, whose programs also multiply only the rank tile their adapter needs
(`_pipelined_steps`). The third (ExpandConfig.m_steps > 1) is B-stationary: a program holds one
column tile of B and walks up to m_steps M-tiles of its group (`_stationary_steps`). Column steps
re-read a [rank, block_n] B tile (from L2) for every M-tile, rank / (2 block_m) times the out bytes;
past rank 64 that traffic, not HBM, bounds a prefill expand, and B-stationary programs, which read
each B tile once, bring it much closer to the cost of streaming out alone (figures:
docs/benchmarks/kernels.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import tiling
from kernels.adapter_arena import ALIGN
from kernels.batch import LoRABatch
from kernels.lora_stack import LoRAStack
from kernels.tiling import ExpandConfig
from kernels.triton import pdl
from kernels.triton.compile_ahead import launcher
from kernels.triton.lora_common import (PER_STEP, dot_precision, find_span, find_tile, group_block, is_pow2,
                                        m_tile_bound, matmul, one_tile_per_group, rank_tile, rows_arg)

MAX_SLICES = 3  # the expand kernel maps N-tiles to at most 3 slices (fused qkv)
# Largest y tile (BLOCK_M x BLOCK_R) whose expand also reads its first B tile before the PDL wait:
# for 128-row, rank-128 tiles holding both costs more in register pressure than the early load
# saves, while smaller tiles gain from it (docs/benchmarks/kernels.md).
PREFETCH_B_MAX_TILE = 64 * 128


def _rank_classes(block_r: int) -> int:
    """Rank tiles pipelined expand steps choose from per program: block_r, and its half and quarter
    while those still make a tl.dot (K >= 16)."""
    return 1 + (block_r >= 32) + (block_r >= 64)


def lora_expand(out: torch.Tensor, y: torch.Tensor, stack: LoRAStack, batch: LoRABatch,
                config: ExpandConfig | None = None, compile_only: bool = False) -> None:
    """out[t, slice s columns] += y.sum(0)[t, s, :r] @ B_sᵀ [r, slice s columns] of the slot's adapter, in place.

    out: [num_tokens, out_features] the base projection's output (any float dtype)
    y:   [splits, num_tokens, num_slices, max_rank] from lora_shrink (splits a power of 2; `y_dtype`)
    Tiles of >= 16 rows multiply in B's dtype (y is rounded to it, as vLLM does, for 16-bit
    tensor cores), smaller ones in fp32; all accumulate and add to out in fp32. Rows of
    base-only tokens and columns of untargeted slices are never written.
    """
    stack.check_expand_args(out, y, batch)
    assert stack.num_slices <= MAX_SLICES and is_pow2(y.shape[0]), (stack.num_slices, y.shape)
    if batch.num_tokens == 0 or batch.capacity == 0:
        return
    sizes = [hi - lo for lo, hi in zip(stack.out_offsets, stack.out_offsets[1:])]
    cfg = config or tiling.expand_config(stack, batch)
    assert cfg.block_m >= 1 and cfg.block_n >= 16 and cfg.n_steps >= 1 and cfg.m_steps >= 1, cfg
    assert cfg.block_m >= 16 or not (cfg.pipeline or cfg.stationary), cfg  # those steps accumulate in tl.dot
    assert not cfg.stationary or (cfg.n_steps == 1 and not cfg.pipeline and is_pow2(cfg.m_steps)), cfg
    # N-tiles (block_n * n_steps columns, one program each) are numbered slice after slice. The
    # kernel always sees 3 slices: missing ones start at the last tile and end at out_features,
    # so no program maps to them.
    tiles = [triton.cdiv(n, cfg.block_n * cfg.n_steps) for n in sizes]
    tile_starts = [sum(tiles[:s]) for s in range(1, MAX_SLICES)]  # first N-tile of slices 1, 2
    ends = [stack.out_offsets[min(s, len(sizes))] for s in range(1, MAX_SLICES + 1)]  # slices 0, 1, 2
    tile_rows = cfg.block_m * cfg.m_steps  # a program's M span
    m_tiles = m_tile_bound(batch, tile_rows)
    block_r = rank_tile(stack, batch)
    args = (y, stack.arena.data, out, stack.b_offsets, stack.ranks, batch.starts, batch.lens, batch.slots,
            rows_arg(out, batch), batch.capacity, stack.num_slices, *ends, *tile_starts, cfg.n_steps, y.shape[-1],
            batch.mix_slot, *y.stride(), out.stride(0), out.stride(1))
    common = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_R=block_r, SPLIT=y.shape[0],
                  GROUP_BLOCK=group_block(batch.capacity), ONE_TILE=one_tile_per_group(batch, tile_rows),
                  GATHER=batch.rows is not None, DOT_PRECISION=dot_precision(stack.dtype), STAGES=cfg.num_stages,
                  MIX=batch.is_mixture, ARENA_ALIGN=ALIGN, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                  **pdl.launch_options(out.device))
    if cfg.stationary:
        launcher(_stationary_kernel, (sum(tiles), m_tiles), compile_only)(
            *args, M_STEPS=cfg.m_steps, RANK_CLASSES=_rank_classes(block_r), **common)
    else:
        launcher(_expand_kernel, (m_tiles, sum(tiles)), compile_only)(
            *args, PREFETCH_B=cfg.block_m * block_r <= PREFETCH_B_MAX_TILE and not cfg.pipeline,
            PIPELINE=cfg.pipeline, RANK_CLASSES=_rank_classes(block_r) if cfg.pipeline else 1, **common)


@triton.jit(**PER_STEP)
def _expand_kernel(
    y_ptr, arena_ptr, out_ptr, b_offsets_ptr, ranks_ptr, starts_ptr, lens_ptr, slots_ptr, rows_ptr,
    num_groups, num_slices, end0, end1, end2, tile_start1, tile_start2, n_steps, max_rank, mix_slot,
    stride_y_split, stride_ym, stride_y_slice, stride_y_rank,
    stride_om, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, SPLIT: tl.constexpr,
    GROUP_BLOCK: tl.constexpr, ONE_TILE: tl.constexpr, GATHER: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PREFETCH_B: tl.constexpr, PIPELINE: tl.constexpr, STAGES: tl.constexpr, RANK_CLASSES: tl.constexpr,
    MIX: tl.constexpr, ARENA_ALIGN: tl.constexpr, PDL: tl.constexpr,
):
    # Before the wait: what no kernel of the step writes (batch metadata, the slot's tables, small tiles' first
    # B tile),
    # so that it is in flight while the previous kernel drains. y and out come after it.
    # grid: (M-tile, N-tile)
    slot, rows, m_mask = find_tile(starts_ptr, lens_ptr, slots_ptr, rows_ptr, num_groups,
                                   BLOCK_M, GROUP_BLOCK, ONE_TILE, GATHER)
    slice_idx, offs_n, span_end, slice_begin, slice_end = _column_span(tl.program_id(1), end0, end1, end2,
                                                                      tile_start1, tile_start2, n_steps, BLOCK_N)
    rank, own_rank, b_ptr, b_stride, b_delta = _slot_slice(ranks_ptr, b_offsets_ptr, arena_ptr, slot, slice_idx,
                                                           num_slices, slice_begin, slice_end, mix_slot, ARENA_ALIGN,
                                                           MIX)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    b_ptrs = _b_tile_ptrs(b_ptr, offs_r, b_stride, offs_n, own_rank, b_delta, MIX)
    if PREFETCH_B:  # [BLOCK_R, BLOCK_N] tile of B_sᵀ of the first step
        b = tl.load(b_ptrs, mask=r_mask[:, None] & (offs_n < span_end)[None, :], other=0.0)
    pdl.wait_for_inputs(PDL)
    if PIPELINE:  # plain column steps: the compiler's pipeliner streams out and B tiles through shared memory
        if rank == 0:  # out is never written
            return
        pdl.start_dependents(PDL)
        _pipelined_steps(y_ptr, b_ptr, b_stride, own_rank, b_delta, out_ptr, rows, m_mask, slice_idx, rank, max_rank,
                         offs_n, span_end, n_steps, stride_y_split, stride_ym, stride_y_slice, stride_y_rank, stride_om,
                         stride_on, BLOCK_M, BLOCK_N, BLOCK_R, RANK_CLASSES, SPLIT, DOT_PRECISION, STAGES, MIX)
    else:
        # y and the first out tile do not need the rank: they are requested before branching on it
        # (branching first delays those loads by the rank's, which small expands feel).
        y = _y_tile(y_ptr, rows, m_mask, slice_idx, offs_r, max_rank, stride_y_split, stride_ym, stride_y_slice,
                    stride_y_rank, SPLIT, BLOCK_M)
        out_ptrs = out_ptr + rows[:, None] * stride_om + offs_n[None, :] * stride_on
        prev = tl.load(out_ptrs, mask=m_mask[:, None] & (offs_n < span_end)[None, :], other=0.0)
        if rank == 0:  # out is never written
            return
        y = tl.where(r_mask[None, :], y, 0.0)
        pdl.start_dependents(PDL)
        # Column steps, each next out tile (HBM) requested before this one's B tile (L2) and product.
        if PREFETCH_B:  # the first step, with its B tile
            nxt = _next_out_tile(out_ptrs, offs_n, span_end, m_mask, BLOCK_N, stride_on)
            _add_product(out_ptrs, prev, y, b, m_mask[:, None] & (offs_n < span_end)[None, :], BLOCK_M, DOT_PRECISION)
            prev = nxt
            offs_n += BLOCK_N
            b_ptrs += BLOCK_N
            out_ptrs += BLOCK_N * stride_on
        for _ in range(1 if PREFETCH_B else 0, n_steps):
            n_mask = offs_n < span_end
            nxt = _next_out_tile(out_ptrs, offs_n, span_end, m_mask, BLOCK_N, stride_on)
            b = tl.load(b_ptrs, mask=r_mask[:, None] & n_mask[None, :], other=0.0)
            _add_product(out_ptrs, prev, y, b, m_mask[:, None] & n_mask[None, :], BLOCK_M, DOT_PRECISION)
            prev = nxt
            offs_n += BLOCK_N
            b_ptrs += BLOCK_N
            out_ptrs += BLOCK_N * stride_on


@triton.jit(**PER_STEP)
def _stationary_kernel(
    y_ptr, arena_ptr, out_ptr, b_offsets_ptr, ranks_ptr, starts_ptr, lens_ptr, slots_ptr, rows_ptr,
    num_groups, num_slices, end0, end1, end2, tile_start1, tile_start2, n_steps, max_rank, mix_slot,
    stride_y_split, stride_ym, stride_y_slice, stride_y_rank,
    stride_om, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, SPLIT: tl.constexpr,
    GROUP_BLOCK: tl.constexpr, ONE_TILE: tl.constexpr, GATHER: tl.constexpr, DOT_PRECISION: tl.constexpr,
    M_STEPS: tl.constexpr, STAGES: tl.constexpr, RANK_CLASSES: tl.constexpr, MIX: tl.constexpr,
    ARENA_ALIGN: tl.constexpr, PDL: tl.constexpr,
):
    # B-stationary expand (`_stationary_steps`). grid: (N-tile, M-tile of M_STEPS tiles of BLOCK_M rows), so that
    # a wave of programs covers a band of rows across all columns (M first was slower).
    slot, pos_begin, pos_end = find_span(tl.program_id(1), starts_ptr, lens_ptr, slots_ptr, num_groups,
                                         BLOCK_M * M_STEPS, GROUP_BLOCK, ONE_TILE)
    slice_idx, offs_n, span_end, slice_begin, slice_end = _column_span(tl.program_id(0), end0, end1, end2,
                                                                      tile_start1, tile_start2, n_steps, BLOCK_N)
    rank, own_rank, b_ptr, b_stride, b_delta = _slot_slice(ranks_ptr, b_offsets_ptr, arena_ptr, slot, slice_idx,
                                                           num_slices, slice_begin, slice_end, mix_slot, ARENA_ALIGN,
                                                           MIX)
    _stationary_steps(y_ptr, b_ptr, b_stride, own_rank, b_delta, out_ptr, rows_ptr, slot, pos_begin, pos_end,
                      slice_idx, rank, max_rank, offs_n, span_end, stride_y_split, stride_ym, stride_y_slice,
                      stride_y_rank, stride_om, stride_on, BLOCK_M, BLOCK_N, BLOCK_R, M_STEPS, RANK_CLASSES, SPLIT,
                      GATHER, DOT_PRECISION, STAGES, MIX, PDL)


@triton.jit
def _column_span(pid_n, end0, end1, end2, tile_start1, tile_start2, n_steps, BLOCK_N: tl.constexpr):
    """(slice, first BLOCK_N columns, end column, the slice's first column, its end column) of N-tile pid_n.
    N-tiles run through slice 0, then 1, then 2, and slice s spans columns [end_{s-1}, end_s) of out
    (end_{-1} = 0)."""
    in1 = pid_n >= tile_start1
    in2 = pid_n >= tile_start2
    slice_idx = in1.to(tl.int32) + in2.to(tl.int32)
    n_begin = tl.where(in2, end1, tl.where(in1, end0, 0))
    n_end = tl.where(in2, end2, tl.where(in1, end1, end0))
    span_begin = n_begin + (pid_n - tl.where(in2, tile_start2, tl.where(in1, tile_start1, 0))) * (BLOCK_N * n_steps)
    span_end = tl.minimum(n_end, span_begin + BLOCK_N * n_steps)  # this program's columns
    return slice_idx, span_begin + tl.arange(0, BLOCK_N), span_end, n_begin, n_end


@triton.jit
def _slot_slice(ranks_ptr, b_offsets_ptr, arena_ptr, slot, slice_idx, num_slices, slice_begin, slice_end, mix_slot,
                ARENA_ALIGN: tl.constexpr, MIX: tl.constexpr):
    """(rank, the slot's own rank, B pointer, B row stride, mixture rows' offset) of the slot's adapter on this
    slice. B_sᵀ is [rank, slice width], rows contiguous in the arena; the pointer is shifted so that out's column n
    of row r is b_ptr + r * b_stride + n. Rank 0 for the grid's slack past the last tile, an empty slot or an
    untargeted slice. Both table entries are loaded at once: their latency is one load's. With MIX, rows past the
    slot's own rank are the mixture slot's (kernels/batch.py), b_delta elements further (`_b_tile_ptrs`)."""
    entry = slot * num_slices + slice_idx
    rank = tl.load(ranks_ptr + entry, mask=slot >= 0, other=0)
    b_offset = tl.multiple_of(tl.load(b_offsets_ptr + entry, mask=slot >= 0, other=0), ARENA_ALIGN)
    b_stride = slice_end - slice_begin
    total, b_delta = rank, b_offset * 0  # one return: its types may not depend on MIX
    if MIX:
        mix_entry = mix_slot * num_slices + slice_idx
        total += tl.where((slot >= 0) & (slot != mix_slot), tl.load(ranks_ptr + mix_entry), 0)
        b_delta = tl.load(b_offsets_ptr + mix_entry) - b_offset - rank * b_stride
    return total, rank, arena_ptr + b_offset - slice_begin, b_stride, b_delta


@triton.jit
def _b_tile_ptrs(b_ptr, offs_r, b_stride, offs_n, own_rank, b_delta, MIX: tl.constexpr):
    """Pointers of B's [ranks, columns] tile: rows offs_r, their rows past own_rank (MIX) the mixture slot's."""
    if MIX:
        ptrs = b_ptr + (offs_r * b_stride + tl.where(offs_r < own_rank, 0, b_delta))[:, None] + offs_n[None, :]
    else:
        ptrs = b_ptr + offs_r[:, None] * b_stride + offs_n[None, :]
    return ptrs


@triton.jit
def _pipelined_steps(y_ptr, b_ptr, b_stride, own_rank, b_delta, out_ptr, rows, m_mask, slice_idx, rank, max_rank,
                     offs_n, span_end, n_steps, stride_y_split, stride_ym, stride_y_slice, stride_y_rank, stride_om,
                     stride_on, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, R: tl.constexpr, CLASSES: tl.constexpr,
                     SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr, STAGES: tl.constexpr, MIX: tl.constexpr):
    """out[rows, this program's columns] += y[rows, :rank] @ B[:rank, columns], in column steps whose out and
    B tiles the compiler prefetches STAGES - 1 steps ahead through shared memory (a loop's own num_stages
    pipelines every load in it; the kernel's, only tl.dot's operands). The steps multiply the narrowest of
    CLASSES rank tiles (R, R/2, R/4) holding the adapter's rank: in a mixed batch, a low-rank adapter's
    programs multiply (and hold) a fraction of the batch's rank tile."""
    if CLASSES > 1 and rank <= R // 2:
        _pipelined_steps(y_ptr, b_ptr, b_stride, own_rank, b_delta, out_ptr, rows, m_mask, slice_idx, rank, max_rank,
                         offs_n, span_end, n_steps, stride_y_split, stride_ym, stride_y_slice, stride_y_rank, stride_om,
                         stride_on, BLOCK_M, BLOCK_N, R // 2, CLASSES - 1, SPLIT, DOT_PRECISION, STAGES, MIX)
    else:
        _pipelined_columns(y_ptr, b_ptr, b_stride, own_rank, b_delta, out_ptr, rows, m_mask, slice_idx, rank,
                           max_rank, offs_n, span_end, n_steps, stride_y_split, stride_ym, stride_y_slice,
                           stride_y_rank, stride_om, stride_on, BLOCK_M, BLOCK_N, R, SPLIT, DOT_PRECISION, STAGES, MIX)


@triton.jit
def _pipelined_columns(y_ptr, b_ptr, b_stride, own_rank, b_delta, out_ptr, rows, m_mask, slice_idx, rank, max_rank,
                       offs_n, span_end, n_steps, stride_y_split, stride_ym, stride_y_slice, stride_y_rank, stride_om,
                       stride_on, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, R: tl.constexpr, SPLIT: tl.constexpr,
                       DOT_PRECISION: tl.constexpr, STAGES: tl.constexpr, MIX: tl.constexpr):
    """_pipelined_steps with a rank tile of R >= rank."""
    offs_r = tl.arange(0, R)
    r_mask = offs_r < rank
    y = tl.where(r_mask[None, :], _y_tile(y_ptr, rows, m_mask, slice_idx, offs_r, max_rank, stride_y_split, stride_ym,
                                          stride_y_slice, stride_y_rank, SPLIT, BLOCK_M), 0.0)
    b_ptrs = _b_tile_ptrs(b_ptr, offs_r, b_stride, offs_n, own_rank, b_delta, MIX)
    out_ptrs = out_ptr + rows[:, None] * stride_om + offs_n[None, :] * stride_on
    for _ in tl.range(0, n_steps, num_stages=STAGES):
        n_mask = offs_n < span_end
        mask = m_mask[:, None] & n_mask[None, :]
        prev = tl.load(out_ptrs, mask=mask, other=0.0)
        b = tl.load(b_ptrs, mask=r_mask[:, None] & n_mask[None, :], other=0.0)
        acc = matmul(y, b, prev.to(tl.float32), BLOCK_M, DOT_PRECISION)
        tl.store(out_ptrs, acc.to(out_ptrs.dtype.element_ty), mask=mask)
        offs_n += BLOCK_N
        b_ptrs += BLOCK_N
        out_ptrs += BLOCK_N * stride_on


@triton.jit
def _stationary_steps(y_ptr, b_ptr, b_stride, own_rank, b_delta, out_ptr, rows_ptr, slot, pos_begin, pos_end,
                      slice_idx, rank, max_rank, offs_n, span_end, stride_y_split, stride_ym, stride_y_slice,
                      stride_y_rank, stride_om, stride_on, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      R: tl.constexpr, M_STEPS: tl.constexpr, CLASSES: tl.constexpr, SPLIT: tl.constexpr,
                      GATHER: tl.constexpr, DOT_PRECISION: tl.constexpr, STAGES: tl.constexpr, MIX: tl.constexpr,
                      PDL: tl.constexpr):
    """out[positions pos_begin..pos_end of the group, this program's columns] += y @ B[:rank, columns], B's tile
    read once (before the PDL wait), then M-tile after M-tile, each tile's y and out loads prefetched
    STAGES - 1 tiles ahead. The rank tile is the narrowest of CLASSES (R, R/2, R/4) holding the adapter's rank,
    as in `_pipelined_steps`."""
    if CLASSES > 1 and rank <= R // 2:
        _stationary_steps(y_ptr, b_ptr, b_stride, own_rank, b_delta, out_ptr, rows_ptr, slot, pos_begin, pos_end,
                          slice_idx, rank, max_rank, offs_n, span_end, stride_y_split, stride_ym, stride_y_slice,
                          stride_y_rank, stride_om, stride_on, BLOCK_M, BLOCK_N, R // 2, M_STEPS, CLASSES - 1, SPLIT,
                          GATHER, DOT_PRECISION, STAGES, MIX, PDL)
    else:
        offs_r = tl.arange(0, R)
        r_mask = offs_r < rank
        n_mask = offs_n < span_end
        b = tl.load(_b_tile_ptrs(b_ptr, offs_r, b_stride, offs_n, own_rank, b_delta, MIX),
                    mask=r_mask[:, None] & n_mask[None, :], other=0.0)
        steps = tl.arange(0, M_STEPS)[:, None]
        if GATHER:  # every step's rows at once: loads in the loop whose address came from a load there (the
            #         rows) were not prefetched, which made such expands markedly slower
            pos_all = pos_begin + steps * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]  # [M_STEPS, BLOCK_M]
            rows_all = tl.load(rows_ptr + pos_all, mask=(pos_all < pos_end) & (slot >= 0), other=0)
        pdl.wait_for_inputs(PDL)
        if rank > 0:  # else out is never written
            pdl.start_dependents(PDL)
            for step in tl.range(0, M_STEPS, num_stages=STAGES):  # tiles past pos_end: all masked
                pos = pos_begin + step * BLOCK_M + tl.arange(0, BLOCK_M)
                m_mask = pos < pos_end
                if GATHER:  # this step's row of rows_all (a register tensor cannot be indexed)
                    rows = tl.sum(tl.where(steps == step, rows_all, 0), axis=0).to(tl.int64)
                else:
                    rows = pos.to(tl.int64)
                # Not masked by the rank: lora_shrink wrote zeros there (a masked load or a select is slower:
                # the tile then passes through registers instead of straight to the product).
                y = _y_tile(y_ptr, rows, m_mask, slice_idx, offs_r, max_rank, stride_y_split, stride_ym,
                            stride_y_slice, stride_y_rank, SPLIT, BLOCK_M)
                out_ptrs = out_ptr + rows[:, None] * stride_om + offs_n[None, :] * stride_on
                mask = m_mask[:, None] & n_mask[None, :]
                prev = tl.load(out_ptrs, mask=mask, other=0.0)
                acc = matmul(y, b, prev.to(tl.float32), BLOCK_M, DOT_PRECISION)
                tl.store(out_ptrs, acc.to(out_ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _y_tile(y_ptr, rows, m_mask, slice_idx, offs_r, max_rank, stride_y_split, stride_ym, stride_y_slice, stride_y_rank,
            SPLIT: tl.constexpr, BLOCK_M: tl.constexpr):
    """y[rows, slice, offs_r] summed over its planes (`_sum_of_planes`); columns past the stack's max rank read as 0
    (a host int: the loads stay vectorized), those past the adapter's own rank are the caller's to mask."""
    y_ptrs = y_ptr + rows[:, None] * stride_ym + slice_idx * stride_y_slice + offs_r[None, :] * stride_y_rank
    y_mask = m_mask[:, None] & (offs_r < max_rank)[None, :]
    return _sum_of_planes(y_ptrs, y_mask, stride_y_split, SPLIT, BLOCK_M)


@triton.jit
def _sum_of_planes(y_ptrs, y_mask, stride_y_split, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr):
    """The sum of y's SPLIT planes at `y_ptrs` (plane 0), as a [BLOCK_M, ranks] tile: float32, or y's own
    dtype when it has one plane. Tiles of 16+ rows load plane after plane (independent loads, all in flight
    at once): one [SPLIT, BLOCK_M, ranks] load holds SPLIT times the registers. A 1-row tile loads all
    planes at once: loaded one by one, many planes made a decode expand several times slower."""
    if SPLIT == 1:
        y = tl.load(y_ptrs, mask=y_mask, other=0.0)
    elif BLOCK_M == 1:
        offs_s = tl.arange(0, SPLIT)[:, None, None] * stride_y_split
        y = tl.sum(tl.load(y_ptrs[None, :, :] + offs_s, mask=y_mask[None, :, :], other=0.0), axis=0)
    else:
        y = tl.load(y_ptrs, mask=y_mask, other=0.0)
        for s in tl.static_range(1, SPLIT):
            y += tl.load(y_ptrs + s * stride_y_split, mask=y_mask, other=0.0)
    return y


@triton.jit
def _next_out_tile(out_ptrs, offs_n, span_end, m_mask, BLOCK_N: tl.constexpr, stride_on):
    """The out tile one step right of `out_ptrs`, zeros past this program's columns."""
    return tl.load(out_ptrs + BLOCK_N * stride_on, mask=m_mask[:, None] & (offs_n + BLOCK_N < span_end)[None, :],
                   other=0.0)


@triton.jit
def _add_product(out_ptrs, prev, y, b, mask, BLOCK_M: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """out tile = prev + y @ b, rounded to out's dtype."""
    delta = matmul(y, b, tl.zeros((y.shape[0], b.shape[1]), dtype=tl.float32), BLOCK_M, DOT_PRECISION)
    tl.store(out_ptrs, (prev.to(tl.float32) + delta).to(out_ptrs.dtype.element_ty), mask=mask)
