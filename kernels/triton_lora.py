"""Triton LoRA ops, behind the same contract as kernels/reference.py.

One program per (M-tile of a segment, slice or N-tile). The grid's M axis counts tiles of the
whole batch rather than (segment x longest segment): with a 2048-token prefill beside 255 decode
segments the latter would launch ~8000 M programs where ~290 have work. Each program finds its
segment with a prefix sum over the segments' tile counts (`_find_tile`, one read of the batch's
small int32 metadata), then returns at once when its slice is untargeted or its slot empty.

Grids come from host ints only (num_tokens, the batch's capacity, the stack's shape; max_seg_len
only picks block sizes), and every per-step value is read from device tensors, so both ops can
be captured in a CUDA graph and replayed with new batch and slot contents.

Tuning knobs live in `shrink_config` / `expand_config` (block sizes, split-K, warps, stages);
tests and benchmarks pass a config explicitly to cover or compare others.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.batch import LoRABatch
from kernels.lora_stack import LoRAStack

MAX_SLICES = 3  # the expand kernel maps N-tiles to at most 3 slices (fused qkv)
DECODE_TOKENS = 64  # batches this small are decode steps (configs assume few live tiles)
TARGET_PROGRAMS = 528  # shrink splits K until about this many programs run: 4 per SM of an H100/H200


@dataclass(frozen=True)
class ShrinkConfig:
    block_m: int     # tokens per tile; < 16: CUDA-core multiply-sum instead of tl.dot (decode)
    block_k: int     # in_features per inner step
    split_k: int     # programs sharing one tile's K range, reduced by fp32 atomics into y
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class ExpandConfig:
    block_m: int     # tokens per tile; < 16: CUDA-core multiply-sum instead of tl.dot (decode)
    block_n: int     # out_features per step; a program's columns never straddle two slices
    n_steps: int     # block_n steps per program: amortizes its prologue, pipelines B loads
    num_warps: int
    num_stages: int


def _block_m(max_seg_len: int) -> int:
    return 16 if max_seg_len <= 16 else 32 if max_seg_len <= 32 else 64


def _block_r(max_rank: int) -> int:
    """Rank tile: the whole (padded) rank at once; columns >= a slice's rank are masked."""
    return max(16, triton.next_power_of_2(max_rank))


def shrink_config(batch: LoRABatch, stack: LoRAStack) -> ShrinkConfig:
    """Starting points, measured on an H200; the lead tunes these.

    Decode-like batches (short segments) leave few programs: (tiles x slices) may not fill the
    SMs, and each would stream its whole A[slot, slice] alone. Split-K then spreads each tile's
    K range over up to TARGET_PROGRAMS programs in all (~1024 of K each at least), each adding
    its partial sum into y with fp32 atomics (results may differ in the last bits between runs).
    Longer tiles keep split_k = 1 (plain stores): split 4 made a 4x512-token prefill 3x slower.
    """
    block_m = _block_m(batch.max_seg_len)  # tl.dot even for decode: multiply-sum measured slower
    block_r = _block_r(stack.max_rank)
    block_k = min(64 if block_m <= 32 or block_r > 64 else 128, max(16, triton.next_power_of_2(stack.in_features)))
    split_k = 1
    if batch.max_seg_len == 1:
        # One token per segment: (segments x slices) programs, each K range split ~512 wide at least
        # (7B shapes, H200: qkv 16 us, o 8 us at 32 segments; wider splits lost to the atomics).
        programs = _m_tile_bound(batch, block_m) * stack.num_slices
        split_k = min(triton.next_power_of_2(triton.cdiv(TARGET_PROGRAMS, programs)),
                      max(1, stack.in_features // 512))
    elif _decode_sized(batch, block_m):
        # A decode batch grouped by adapter may have a single live tile: spread its K range ~256
        # wide (7B shapes, H200, one 32-token segment: qkv 14.6 us, o 12.8 us).
        split_k = min(triton.next_power_of_2(triton.cdiv(TARGET_PROGRAMS, stack.num_slices)),
                      max(1, stack.in_features // 256))
    elif block_m <= 32:
        programs = _m_tile_bound(batch, block_m) * stack.num_slices
        split_k = min(triton.next_power_of_2(triton.cdiv(TARGET_PROGRAMS, programs)),
                      max(1, stack.in_features // 1024))
    return ShrinkConfig(block_m, block_k, split_k, num_warps=4, num_stages=3 if block_r <= 64 else 2)


def expand_config(batch: LoRABatch, stack: LoRAStack) -> ExpandConfig:
    """Starting points, measured on an H200; the lead tunes these. The rank fits one tile: no K loop.

    One-token segments (decode) take 1-row tiles, multiplied on CUDA cores: ~15% faster than a
    16-row tl.dot that wastes 15 rows and moves B through shared memory.
    """
    max_slice = max(hi - lo for lo, hi in zip(stack.out_offsets, stack.out_offsets[1:]))
    block_n = min(128, max(16, triton.next_power_of_2(max_slice)))
    if batch.max_seg_len == 1:  # multiply-sum tile [block_r, block_n]: <= 64 fp32 registers a thread
        block_n = max(16, min(block_n, 8192 // _block_r(stack.max_rank)))
        return ExpandConfig(1, block_n, n_steps=4, num_warps=4, num_stages=3)
    block_m = _block_m(batch.max_seg_len)
    if _decode_sized(batch, block_m):  # possibly one live tile: one N step a program (qkv 7 us, o 5 us)
        return ExpandConfig(block_m, block_n, n_steps=1, num_warps=4, num_stages=2)
    return ExpandConfig(block_m, block_n, n_steps=2, num_warps=4, num_stages=2)


def _decode_sized(batch: LoRABatch, block_m: int) -> bool:
    """A decode step on tensor-core tiles (as captured in a CUDA graph for sequences grouped by
    adapter): few tokens, so few live tiles, whatever the capacity says."""
    return block_m >= 16 and batch.num_tokens <= DECODE_TOKENS


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 models get exact fp32 products (tf32 would lose 13 mantissa bits); 16-bit inputs
    # ignore the setting.
    return "ieee" if dtype == torch.float32 else "tf32"


def _one_tile_per_segment(batch: LoRABatch, block_m: int) -> bool:
    """Decode-like batches: M-tile i is segment i, and programs need not search for their tile."""
    return batch.max_seg_len <= block_m


def _m_tile_bound(batch: LoRABatch, block_m: int) -> int:
    """Host bound on the M-tiles of all segments: each segment adds at most one partial tile."""
    if _one_tile_per_segment(batch, block_m):
        return batch.capacity
    return triton.cdiv(batch.num_tokens, block_m) + min(batch.capacity, batch.num_tokens)


def _seg_block(capacity: int) -> int:
    """Segments each program scans to find its tile (metadata read, no weights)."""
    return max(16, triton.next_power_of_2(capacity))


def lora_shrink(x: torch.Tensor, stack: LoRAStack, batch: LoRABatch,
                config: ShrinkConfig | None = None) -> torch.Tensor:
    """y[t, s, :r] = scaling[slot] * x[t] @ A[slot, s, :r]ᵀ for tokens of segments using a slot.

    x:      [num_tokens, in_features], stack.a's dtype
    returns y: float32 [num_tokens, num_slices, max_rank], zero-filled first (split-K adds into
            it); entries no segment writes stay zero.
    """
    stack.check_shrink_args(x, batch)
    assert x.dtype == stack.a.dtype, (x.dtype, stack.a.dtype)
    y = torch.zeros(batch.num_tokens, stack.num_slices, stack.max_rank, dtype=torch.float32, device=x.device)
    if batch.num_tokens == 0 or batch.capacity == 0:
        return y
    cfg = config or shrink_config(batch, stack)
    assert cfg.block_m >= 1 and cfg.block_k >= 16 and cfg.split_k >= 1, cfg
    # K range of one split, a multiple of block_k; trailing splits may get an empty range.
    k_per_split = triton.cdiv(triton.cdiv(stack.in_features, cfg.split_k), cfg.block_k) * cfg.block_k
    grid = (_m_tile_bound(batch, cfg.block_m), stack.num_slices * cfg.split_k)
    _shrink_kernel[grid](
        x, stack.a, y, stack.ranks, stack.scalings, batch.starts, batch.lens, batch.slots,
        batch.capacity, stack.in_features, k_per_split,
        x.stride(0), x.stride(1),
        *stack.a.stride(),
        *y.stride(),
        stack.ranks.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k, BLOCK_R=_block_r(stack.max_rank), SPLIT_K=cfg.split_k,
        SEG_BLOCK=_seg_block(batch.capacity), ONE_TILE=_one_tile_per_segment(batch, cfg.block_m),
        DOT_PRECISION=_dot_precision(x.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return y


def lora_expand(out: torch.Tensor, y: torch.Tensor, stack: LoRAStack, batch: LoRABatch,
                config: ExpandConfig | None = None) -> None:
    """out[t, slice s columns] += y[t, s, :r] @ B[slot, slice s rows, :r]ᵀ, in place.

    out: [num_tokens, out_features] the base projection's output (any float dtype)
    y:   float32 [num_tokens, num_slices, max_rank] from lora_shrink
    Tiles of >= 16 rows multiply in B's dtype (y is rounded to it, as vLLM does, for 16-bit
    tensor cores), smaller ones in fp32; all accumulate and add to out in fp32. Rows of
    base-only tokens and columns of untargeted slices are never written.
    """
    stack.check_expand_args(out, y, batch)
    assert stack.num_slices <= MAX_SLICES, stack.num_slices
    if batch.num_tokens == 0 or batch.capacity == 0:
        return
    sizes = [hi - lo for lo, hi in zip(stack.out_offsets, stack.out_offsets[1:])]
    cfg = config or expand_config(batch, stack)
    assert cfg.block_m >= 1 and cfg.block_n >= 16 and cfg.n_steps >= 1, cfg
    # N-tiles (block_n * n_steps columns, one program each) are numbered slice after slice. The
    # kernel always sees 3 slices: missing ones start at the last tile and end at out_features,
    # so no program maps to them.
    tiles = [triton.cdiv(n, cfg.block_n * cfg.n_steps) for n in sizes]
    tile_starts = [sum(tiles[:s]) for s in range(1, MAX_SLICES)]  # first N-tile of slices 1, 2
    ends = [stack.out_offsets[min(s, len(sizes))] for s in range(1, MAX_SLICES + 1)]  # slices 0, 1, 2
    grid = (_m_tile_bound(batch, cfg.block_m), sum(tiles))
    _expand_kernel[grid](
        y, stack.b, out, stack.ranks, batch.starts, batch.lens, batch.slots,
        batch.capacity, *ends, *tile_starts,
        *y.stride(),
        *stack.b.stride(),
        out.stride(0), out.stride(1),
        stack.ranks.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, N_STEPS=cfg.n_steps, BLOCK_R=_block_r(stack.max_rank),
        SEG_BLOCK=_seg_block(batch.capacity), ONE_TILE=_one_tile_per_segment(batch, cfg.block_m),
        DOT_PRECISION=_dot_precision(stack.b.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


@triton.jit
def _find_tile(starts_ptr, lens_ptr, slots_ptr, num_segments,
               BLOCK_M: tl.constexpr, SEG_BLOCK: tl.constexpr, ONE_TILE: tl.constexpr):
    """(slot, first row, segment's end row) of this program's M-tile; slot -1: nothing to do.

    program_id(0) counts the M-tiles of segments with a slot, segment after segment. Example,
    BLOCK_M 16, starts (0, 20, 25), lens (20, 5, 3), slots (4, NO_SLOT, 1): tiles (2, 0, 1);
    program 1 -> (4, 16, 20), program 2 -> (1, 25, 28), program 3 -> (-1, 0, 0).
    All from one read of the batch metadata: before its weights a program waits only on it and
    on its slot's rank. With ONE_TILE (no segment longer than BLOCK_M) tile i is segment i.
    """
    pid = tl.program_id(0)
    if ONE_TILE:
        row_begin = tl.load(starts_ptr + pid)
        row_end = row_begin + tl.load(lens_ptr + pid)
        slot = tl.where(row_end > row_begin, tl.load(slots_ptr + pid), -1)
    else:
        offs = tl.arange(0, SEG_BLOCK)
        valid = offs < num_segments
        starts = tl.load(starts_ptr + offs, mask=valid, other=0)
        lens = tl.load(lens_ptr + offs, mask=valid, other=0)
        slots = tl.load(slots_ptr + offs, mask=valid, other=-1)
        tiles = tl.where(slots >= 0, (lens + BLOCK_M - 1) // BLOCK_M, 0)  # [SEG_BLOCK]
        ends = tl.cumsum(tiles, axis=0)
        mine = (ends - tiles <= pid) & (pid < ends)  # one-hot: the segment holding tile pid, if any
        slot = tl.sum(tl.where(mine, slots + 1, 0), axis=0) - 1
        row_begin = tl.sum(tl.where(mine, starts + (pid - ends + tiles) * BLOCK_M, 0), axis=0)
        row_end = tl.sum(tl.where(mine, starts + lens, 0), axis=0)
    return slot, row_begin, row_end


@triton.jit
def _matmul(a, b, acc, BLOCK_M: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc + a @ b in fp32; a: [BLOCK_M, K], b: [K, N]. tl.dot needs 16 rows and runs in b's
    dtype (a is rounded to it); fewer rows (decode tiles) multiply and sum in fp32 on CUDA
    cores, which needs neither padding nor shared memory."""
    if BLOCK_M >= 16:
        acc = tl.dot(a.to(b.dtype), b, acc, input_precision=DOT_PRECISION)
    else:
        acc += tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    return acc


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, y_ptr, ranks_ptr, scalings_ptr, starts_ptr, lens_ptr, slots_ptr,
    num_segments, in_features, k_per_split,
    stride_xm, stride_xk,
    stride_a_slot, stride_a_slice, stride_a_rank, stride_ak,
    stride_ym, stride_y_slice, stride_y_rank,
    stride_ranks_slot,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, SPLIT_K: tl.constexpr,
    SEG_BLOCK: tl.constexpr, ONE_TILE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # grid: (M-tile, slice * SPLIT_K + split)
    slot, row_begin, row_end = _find_tile(starts_ptr, lens_ptr, slots_ptr, num_segments,
                                          BLOCK_M, SEG_BLOCK, ONE_TILE)
    if slot < 0:  # the grid's slack past the last tile
        return
    slice_idx = tl.program_id(1) // SPLIT_K
    rank = tl.load(ranks_ptr + slot * stride_ranks_slot + slice_idx)
    if rank == 0:  # empty slot, or its adapter does not target this slice
        return
    scaling = tl.load(scalings_ptr + slot)
    k_begin = (tl.program_id(1) % SPLIT_K) * k_per_split

    rows = row_begin + tl.arange(0, BLOCK_M)  # [BLOCK_M] token indices
    m_mask = rows < row_end
    rows = rows.to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank  # the slice's true rank: padded rows of A are never read
    offs_k = k_begin + tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk  # [BLOCK_M, BLOCK_K]
    a_ptrs = (a_ptr + slot.to(tl.int64) * stride_a_slot + slice_idx * stride_a_slice
              + offs_r[None, :] * stride_a_rank + offs_k[:, None] * stride_ak)  # [BLOCK_K, BLOCK_R] = Aᵀ tile
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    # Host-int trip count (k_per_split is a multiple of BLOCK_K): only in_features masks K.
    for k in range(0, k_per_split, BLOCK_K):
        k_mask = offs_k + k < in_features
        x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        a = tl.load(a_ptrs, mask=r_mask[None, :] & k_mask[:, None], other=0.0)
        acc = _matmul(x, a, acc, BLOCK_M, DOT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        a_ptrs += BLOCK_K * stride_ak
    acc = acc * scaling
    y_ptrs = y_ptr + rows[:, None] * stride_ym + slice_idx * stride_y_slice + offs_r[None, :] * stride_y_rank
    y_mask = m_mask[:, None] & r_mask[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc, mask=y_mask)
    else:
        tl.atomic_add(y_ptrs, acc, mask=y_mask)


@triton.jit
def _expand_kernel(
    y_ptr, b_ptr, out_ptr, ranks_ptr, starts_ptr, lens_ptr, slots_ptr,
    num_segments, end0, end1, end2, tile_start1, tile_start2,
    stride_ym, stride_y_slice, stride_y_rank,
    stride_b_slot, stride_bn, stride_b_rank,
    stride_om, stride_on,
    stride_ranks_slot,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, N_STEPS: tl.constexpr, BLOCK_R: tl.constexpr,
    SEG_BLOCK: tl.constexpr, ONE_TILE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # grid: (M-tile, N-tile); N-tiles run through slice 0, then 1, then 2, and slice s spans
    # columns [end_{s-1}, end_s) of out (end_{-1} = 0).
    slot, row_begin, row_end = _find_tile(starts_ptr, lens_ptr, slots_ptr, num_segments,
                                          BLOCK_M, SEG_BLOCK, ONE_TILE)
    if slot < 0:  # the grid's slack past the last tile
        return
    pid_n = tl.program_id(1)
    in1 = pid_n >= tile_start1
    in2 = pid_n >= tile_start2
    slice_idx = in1.to(tl.int32) + in2.to(tl.int32)
    rank = tl.load(ranks_ptr + slot * stride_ranks_slot + slice_idx)
    if rank == 0:  # empty slot, or its adapter does not target this slice
        return
    n_begin = tl.where(in2, end1, tl.where(in1, end0, 0))
    n_end = tl.where(in2, end2, tl.where(in1, end1, end0))
    first_tile = tl.where(in2, tile_start2, tl.where(in1, tile_start1, 0))

    rows = row_begin + tl.arange(0, BLOCK_M)  # [BLOCK_M] token indices
    m_mask = rows < row_end
    rows = rows.to(tl.int64)
    offs_n = n_begin + (pid_n - first_tile) * (BLOCK_N * N_STEPS) + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    y = tl.load(y_ptr + rows[:, None] * stride_ym + slice_idx * stride_y_slice + offs_r[None, :] * stride_y_rank,
                mask=m_mask[:, None] & r_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_R] fp32
    b_ptrs = b_ptr + slot.to(tl.int64) * stride_b_slot + offs_r[:, None] * stride_b_rank + offs_n[None, :] * stride_bn
    out_ptrs = out_ptr + rows[:, None] * stride_om + offs_n[None, :] * stride_on
    for step in range(N_STEPS):
        n_mask = offs_n + step * BLOCK_N < n_end
        b = tl.load(b_ptrs, mask=r_mask[:, None] & n_mask[None, :], other=0.0)  # [BLOCK_R, BLOCK_N] = Bᵀ tile
        delta = _matmul(y, b, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), BLOCK_M, DOT_PRECISION)
        out_mask = m_mask[:, None] & n_mask[None, :]
        prev = tl.load(out_ptrs, mask=out_mask, other=0.0)
        tl.store(out_ptrs, (prev.to(tl.float32) + delta).to(out_ptr.dtype.element_ty), mask=out_mask)
        b_ptrs += BLOCK_N * stride_bn
        out_ptrs += BLOCK_N * stride_on
