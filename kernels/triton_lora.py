"""Triton LoRA ops (ATMM), behind the same contract as kernels/reference.py.

One program per (M-tile of a group, slice x K-split) for shrink and (M-tile, N-tile) for expand.
A group is every token of one adapter slot (kernels/batch.py), so an adapter's weights are read
once per tile of its tokens however its requests interleave; when its tokens are scattered, the
program gathers its rows through the batch's row order. The grid's M axis counts tiles of the
whole batch rather than (groups x largest group): with a 2048-token prefill beside 255 decode
groups the latter would launch ~8000 M programs where ~290 have work. Each program finds its
group with a prefix sum over the groups' tile counts (`_find_tile`, one read of the batch's small
int32 metadata), then returns at once when its slice is untargeted or its slot empty.

Shrink may split K over `split_k` programs; each stores its partial product in its own plane of
y ([split_k, tokens, slices, ranks], float32) and expand sums the planes in the same load that reads
y. That needs no zero-filled y (a memset node per call in a graph) and no atomics (results are
deterministic): decode shrinks went from 3.4-4.4 to 2.1-2.3 us on an H200. The price is paid in
expand, every program of which loads split_k [BLOCK_M, BLOCK_R] tiles: 32 planes of rank 16
add ~0.3 us to a 1-row decode tile, while 32 planes of rank 64 for 16-row tiles cost more than
the split saved; kernels.tune caps the product (PLANE_TILE_CAP). An unsplit shrink writes its one
plane in x's dtype (`y_dtype`): the expand's tensor-core tiles round y to it anyway, and half the
bytes matter to B-stationary expands, which re-read y for every column tile.

Expand programs come in three kinds. Two walk column steps over one M-tile (ExpandConfig.pipeline):
each next out tile loaded one step ahead into registers, or a loop the compiler pipelines through
shared memory, whose programs also multiply only the rank tile their adapter needs
(`_pipelined_steps`). The third (ExpandConfig.m_steps > 1) is B-stationary: a program holds one
column tile of B and walks up to m_steps M-tiles of its group (`_stationary_steps`). Column steps
re-read a [rank, block_n] B tile (from L2) for every M-tile, rank / (2 block_m) times the out bytes;
past rank 64 that traffic, not HBM, bounds a prefill expand. On an H200, one rank-128 adapter over 8192
tokens ran 61 us with the static column-step tiles and 44 us B-stationary (bare out += 1: 36 us;
benchmarks/expand_ladder.py).

Grids come from host ints only (num_tokens, the batch's capacity, the stack's shape;
max_group_len only picks the configuration), and every per-step value is read from device
tensors, so both ops can be captured in a CUDA graph and replayed with new batch and slot
contents. Tile shapes come from the offline-tuned table (kernels/tuning.py), by shape bucket.

Under PDL (kernels/pdl.py) both kernels read the batch metadata, the ranks and their first weight
tile before waiting on the kernel launched just before them: that kernel must not write the stack
or the batch's device tensors. The engine loads adapters and copies batches in between steps.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl, tuning
from kernels.batch import LoRABatch
from kernels.compile_ahead import launcher
from kernels.lora_stack import LoRAStack
from kernels.tuning import ExpandConfig, ShrinkConfig

MAX_SLICES = 3  # the expand kernel maps N-tiles to at most 3 slices (fused qkv)
# Largest y tile (BLOCK_M x BLOCK_R) whose expand also reads its first B tile before the PDL wait:
# holding both made 128-row, rank-128 tiles 20-40% slower on an H200 (register pressure), while
# smaller tiles gained up to 1.2x.
PREFETCH_B_MAX_TILE = 64 * 128


def _block_r(stack: LoRAStack, batch: LoRABatch) -> int:
    """Rank tile: every rank the batch may use at once; columns >= a slice's rank are masked."""
    return max(16, triton.next_power_of_2(batch.rank_bound(stack.max_rank)))


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 models get exact fp32 products (tf32 would lose 13 mantissa bits); 16-bit inputs
    # ignore the setting.
    return "ieee" if dtype == torch.float32 else "tf32"


def _one_tile_per_group(batch: LoRABatch, block_m: int) -> bool:
    """Decode-like batches: M-tile i is group i, and programs need not search for their tile."""
    return batch.max_group_len <= block_m


def _m_tile_bound(batch: LoRABatch, block_m: int) -> int:
    """Host bound on the M-tiles of all groups: each group adds at most one partial tile."""
    if _one_tile_per_group(batch, block_m):
        return batch.capacity
    return triton.cdiv(batch.num_tokens, block_m) + min(batch.capacity, batch.num_tokens)


def group_block(capacity: int) -> int:
    """Groups each program scans to find its tile (metadata read, no weights); at least 64 so
    that batches of up to 64 adapters share one compiled kernel."""
    return max(64, triton.next_power_of_2(capacity))


def _rank_classes(block_r: int) -> int:
    """Rank tiles pipelined expand steps choose from per program: block_r, and its half and quarter
    while those still make a tl.dot (K >= 16)."""
    return 1 + (block_r >= 32) + (block_r >= 64)


def _is_pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def _rows_arg(x: torch.Tensor, batch: LoRABatch) -> torch.Tensor:
    return x if batch.rows is None else batch.rows  # any tensor: GATHER=False never reads it


def y_dtype(split_k: int, dtype: torch.dtype) -> torch.dtype:
    """The dtype of the y lora_shrink returns: float32 partial sums when K is split, else the model's."""
    return torch.float32 if split_k > 1 else dtype


def lora_shrink(x: torch.Tensor, stack: LoRAStack, batch: LoRABatch,
                config: ShrinkConfig | None = None, compile_only: bool = False) -> torch.Tensor:
    """y.sum(0)[t, s, :r] = scaling[slot] * x[t] @ A[slot, s, :r]ᵀ for tokens of groups using a
    slot, and zeros past r up to the batch's rank tile (`_block_r`); other entries are unspecified.

    x:      [num_tokens, in_features], stack.a's dtype
    returns y: [split_k, num_tokens, num_slices, max_rank] (`y_dtype`), one partial sum over K a plane
    compile_only: compile the kernel for these arguments without launching it (kernels.tune)
    """
    stack.check_shrink_args(x, batch)
    assert x.dtype == stack.a.dtype, (x.dtype, stack.a.dtype)
    cfg = config or tuning.shrink_config(stack, batch)
    assert cfg.block_m >= 1 and cfg.block_k >= 16 and _is_pow2(cfg.split_k), cfg  # expand: tl.arange(split_k)
    y = torch.empty(cfg.split_k, batch.num_tokens, stack.num_slices, stack.max_rank,
                    dtype=y_dtype(cfg.split_k, x.dtype), device=x.device)
    if batch.num_tokens == 0 or batch.capacity == 0:
        return y
    # K range of one split, a multiple of block_k; trailing splits may get an empty range.
    k_per_split = triton.cdiv(triton.cdiv(stack.in_features, cfg.split_k), cfg.block_k) * cfg.block_k
    block_r = _block_r(stack, batch)
    rank_block = min(cfg.rank_block or block_r, block_r)
    assert _is_pow2(rank_block) and (cfg.block_m < 16 or rank_block >= 16), cfg  # tl.dot: N >= 16
    grid = (_m_tile_bound(batch, cfg.block_m), stack.num_slices * cfg.split_k * (block_r // rank_block))
    launcher(_shrink_kernel, grid, compile_only)(
        x, stack.a, y, stack.ranks, stack.scalings, batch.starts, batch.lens, batch.slots, _rows_arg(x, batch),
        batch.capacity, stack.in_features, stack.num_slices, cfg.split_k, k_per_split, stack.max_rank,
        x.stride(0), x.stride(1),
        *stack.a.stride(),
        *y.stride(),
        stack.ranks.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k, BLOCK_R=rank_block,
        GROUP_BLOCK=group_block(batch.capacity), ONE_TILE=_one_tile_per_group(batch, cfg.block_m),
        GATHER=batch.rows is not None, DOT_PRECISION=_dot_precision(x.dtype), ONE_STEP=k_per_split == cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.launch_options(x.device),
    )
    return y


def lora_expand(out: torch.Tensor, y: torch.Tensor, stack: LoRAStack, batch: LoRABatch,
                config: ExpandConfig | None = None, compile_only: bool = False) -> None:
    """out[t, slice s columns] += y.sum(0)[t, s, :r] @ stack.b[slot, :r, slice s columns], in place.

    out: [num_tokens, out_features] the base projection's output (any float dtype)
    y:   [splits, num_tokens, num_slices, max_rank] from lora_shrink (splits a power of 2; `y_dtype`)
    Tiles of >= 16 rows multiply in B's dtype (y is rounded to it, as vLLM does, for 16-bit
    tensor cores), smaller ones in fp32; all accumulate and add to out in fp32. Rows of
    base-only tokens and columns of untargeted slices are never written.
    """
    stack.check_expand_args(out, y, batch)
    assert stack.num_slices <= MAX_SLICES and _is_pow2(y.shape[0]), (stack.num_slices, y.shape)
    if batch.num_tokens == 0 or batch.capacity == 0:
        return
    sizes = [hi - lo for lo, hi in zip(stack.out_offsets, stack.out_offsets[1:])]
    cfg = config or tuning.expand_config(stack, batch)
    assert cfg.block_m >= 1 and cfg.block_n >= 16 and cfg.n_steps >= 1 and cfg.m_steps >= 1, cfg
    assert cfg.block_m >= 16 or not (cfg.pipeline or cfg.stationary), cfg  # those steps accumulate in tl.dot
    assert not cfg.stationary or (cfg.n_steps == 1 and not cfg.pipeline and _is_pow2(cfg.m_steps)), cfg
    # N-tiles (block_n * n_steps columns, one program each) are numbered slice after slice. The
    # kernel always sees 3 slices: missing ones start at the last tile and end at out_features,
    # so no program maps to them.
    tiles = [triton.cdiv(n, cfg.block_n * cfg.n_steps) for n in sizes]
    tile_starts = [sum(tiles[:s]) for s in range(1, MAX_SLICES)]  # first N-tile of slices 1, 2
    ends = [stack.out_offsets[min(s, len(sizes))] for s in range(1, MAX_SLICES + 1)]  # slices 0, 1, 2
    tile_rows = cfg.block_m * cfg.m_steps  # a program's M span
    m_tiles = _m_tile_bound(batch, tile_rows)
    block_r = _block_r(stack, batch)
    args = (y, stack.b, out, stack.ranks, batch.starts, batch.lens, batch.slots, _rows_arg(out, batch),
            batch.capacity, *ends, *tile_starts, cfg.n_steps, stack.max_rank,
            *y.stride(), *stack.b.stride(), out.stride(0), out.stride(1), stack.ranks.stride(0))
    common = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_R=block_r, SPLIT=y.shape[0],
                  GROUP_BLOCK=group_block(batch.capacity), ONE_TILE=_one_tile_per_group(batch, tile_rows),
                  GATHER=batch.rows is not None, DOT_PRECISION=_dot_precision(stack.b.dtype), STAGES=cfg.num_stages,
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.launch_options(out.device))
    if cfg.stationary:
        launcher(_stationary_kernel, (sum(tiles), m_tiles), compile_only)(
            *args, M_STEPS=cfg.m_steps, RANK_CLASSES=_rank_classes(block_r), **common)
    else:
        launcher(_expand_kernel, (m_tiles, sum(tiles)), compile_only)(
            *args, PREFETCH_B=cfg.block_m * block_r <= PREFETCH_B_MAX_TILE and not cfg.pipeline,
            PIPELINE=cfg.pipeline, RANK_CLASSES=_rank_classes(block_r) if cfg.pipeline else 1, **common)


@triton.jit
def _find_tile(starts_ptr, lens_ptr, slots_ptr, rows_ptr, num_groups,
               BLOCK_M: tl.constexpr, GROUP_BLOCK: tl.constexpr, ONE_TILE: tl.constexpr,
               GATHER: tl.constexpr):
    """(slot, token rows [BLOCK_M] int64, row mask) of this program's M-tile; slot -1: nothing to do."""
    slot, pos_begin, pos_end = _find_span(tl.program_id(0), starts_ptr, lens_ptr, slots_ptr, num_groups, BLOCK_M,
                                          GROUP_BLOCK, ONE_TILE)
    rows, m_mask = _tile_rows(rows_ptr, slot, pos_begin, pos_end, BLOCK_M, GATHER)
    return slot, rows, m_mask


@triton.jit
def _find_span(pid, starts_ptr, lens_ptr, slots_ptr, num_groups, TILE_ROWS: tl.constexpr, GROUP_BLOCK: tl.constexpr,
               ONE_TILE: tl.constexpr):
    """(slot, first position, end position) of M-tile `pid`, of up to TILE_ROWS positions; slot -1: nothing to do.

    The M axis of the grid counts the M-tiles of groups with a slot, group after group. Example,
    TILE_ROWS 16, starts (0, 20, 25), lens (20, 5, 3), slots (4, NO_SLOT, 1): tiles (2, 0, 1);
    program 1 -> slot 4, positions 16..19; program 2 -> slot 1, positions 25..27; program 3 -> -1.
    All from one read of the batch metadata: before its weights a program waits only on it (and
    on the row order when gathering). With ONE_TILE (no group longer than TILE_ROWS) tile i is group i.
    """
    if ONE_TILE:
        pos_begin = tl.load(starts_ptr + pid)
        pos_end = pos_begin + tl.load(lens_ptr + pid)
        slot = tl.where(pos_end > pos_begin, tl.load(slots_ptr + pid), -1)
    else:
        offs = tl.arange(0, GROUP_BLOCK)
        valid = offs < num_groups
        starts = tl.load(starts_ptr + offs, mask=valid, other=0)
        lens = tl.load(lens_ptr + offs, mask=valid, other=0)
        slots = tl.load(slots_ptr + offs, mask=valid, other=-1)
        tiles = tl.where(slots >= 0, (lens + TILE_ROWS - 1) // TILE_ROWS, 0)  # [GROUP_BLOCK]
        ends = tl.cumsum(tiles, axis=0)
        mine = (ends - tiles <= pid) & (pid < ends)  # one-hot: the group holding tile pid, if any
        slot = tl.sum(tl.where(mine, slots + 1, 0), axis=0) - 1
        pos_begin = tl.sum(tl.where(mine, starts + (pid - ends + tiles) * TILE_ROWS, 0), axis=0)
        pos_end = tl.sum(tl.where(mine, tl.minimum(starts + lens, starts + (pid - ends + tiles + 1) * TILE_ROWS), 0),
                         axis=0)
    return slot, pos_begin, pos_end


@triton.jit
def _tile_rows(rows_ptr, slot, pos_begin, pos_end, BLOCK_M: tl.constexpr, GATHER: tl.constexpr):
    """(token rows [BLOCK_M] int64, row mask) of positions pos_begin.. (< pos_end) of a group."""
    pos = pos_begin + tl.arange(0, BLOCK_M)
    m_mask = pos < pos_end
    if GATHER:
        rows = tl.load(rows_ptr + pos, mask=m_mask & (slot >= 0), other=0)
    else:
        rows = pos
    return rows.to(tl.int64), m_mask


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


# Values that change from step to step are not specialized on (ints == 1 or multiples of 16; the
# batch metadata's 16-byte alignment, which follows its capacity): each new combination would
# compile another variant while serving (kernels/lora_warmup.py).
_PER_STEP = dict(do_not_specialize=["num_groups", "stride_y_split"],
                 do_not_specialize_on_alignment=["starts_ptr", "lens_ptr", "slots_ptr", "rows_ptr"])


@triton.jit(**_PER_STEP)
def _shrink_kernel(
    x_ptr, a_ptr, y_ptr, ranks_ptr, scalings_ptr, starts_ptr, lens_ptr, slots_ptr, rows_ptr,
    num_groups, in_features, num_slices, split_k, k_per_split, y_ranks,
    stride_xm, stride_xk,
    stride_a_slot, stride_a_slice, stride_a_rank, stride_ak,
    stride_y_split, stride_ym, stride_y_slice, stride_y_rank,
    stride_ranks_slot,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    GROUP_BLOCK: tl.constexpr, ONE_TILE: tl.constexpr, GATHER: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ONE_STEP: tl.constexpr, PDL: tl.constexpr,
):
    # Before the wait: what no kernel of the step writes (batch metadata, ranks, A), so that it is
    # in flight while the previous kernel drains. x comes after it.
    # grid: (M-tile, (rank block * slices + slice) * split_k + split); BLOCK_R ranks a program
    slot, rows, m_mask = _find_tile(starts_ptr, lens_ptr, slots_ptr, rows_ptr, num_groups,
                                    BLOCK_M, GROUP_BLOCK, ONE_TILE, GATHER)
    pid = tl.program_id(1)
    split = pid % split_k
    slice_idx = (pid // split_k) % num_slices
    r_begin = (pid // (split_k * num_slices)) * BLOCK_R
    # 0 for the grid's slack past the last tile, an empty slot or an untargeted slice
    rank = tl.load(ranks_ptr + slot * stride_ranks_slot + slice_idx, mask=slot >= 0, other=0)
    k_begin = split * k_per_split
    offs_r = r_begin + tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank  # the slice's true rank: padded rows of A are never read
    offs_k = k_begin + tl.arange(0, BLOCK_K)
    a_ptrs = (a_ptr + slot.to(tl.int64) * stride_a_slot + slice_idx * stride_a_slice
              + offs_r[None, :] * stride_a_rank + offs_k[:, None] * stride_ak)  # [BLOCK_K, BLOCK_R] = Aᵀ tile
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
    scaling = tl.load(scalings_ptr + slot)
    x_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk  # [BLOCK_M, BLOCK_K]
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    if ONE_STEP:
        x = tl.load(x_ptrs, mask=m_mask[:, None] & (offs_k < in_features)[None, :], other=0.0)
        acc = _matmul(x, a, acc, BLOCK_M, DOT_PRECISION)
    else:
        for k in range(0, k_per_split, BLOCK_K):
            k_mask = offs_k + k < in_features
            x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            a = tl.load(a_ptrs, mask=r_mask[None, :] & k_mask[:, None], other=0.0)
            acc = _matmul(x, a, acc, BLOCK_M, DOT_PRECISION)
            x_ptrs += BLOCK_K * stride_xk
            a_ptrs += BLOCK_K * stride_ak
    pdl.start_dependents(PDL)
    # Every split stores its plane, an empty K range too (zeros): expand sums all planes.
    tl.store(y_ptrs, (acc * scaling).to(y_ptr.dtype.element_ty), mask=y_mask)


@triton.jit(**_PER_STEP)
def _expand_kernel(
    y_ptr, b_ptr, out_ptr, ranks_ptr, starts_ptr, lens_ptr, slots_ptr, rows_ptr,
    num_groups, end0, end1, end2, tile_start1, tile_start2, n_steps, max_rank,
    stride_y_split, stride_ym, stride_y_slice, stride_y_rank,
    stride_b_slot, stride_b_rank, stride_bn,
    stride_om, stride_on,
    stride_ranks_slot,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, SPLIT: tl.constexpr,
    GROUP_BLOCK: tl.constexpr, ONE_TILE: tl.constexpr, GATHER: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PREFETCH_B: tl.constexpr, PIPELINE: tl.constexpr, STAGES: tl.constexpr, RANK_CLASSES: tl.constexpr,
    PDL: tl.constexpr,
):
    # Before the wait: what no kernel of the step writes (batch metadata, ranks, small tiles' first B tile),
    # so that it is in flight while the previous kernel drains. y and out come after it.
    # grid: (M-tile, N-tile)
    slot, rows, m_mask = _find_tile(starts_ptr, lens_ptr, slots_ptr, rows_ptr, num_groups,
                                    BLOCK_M, GROUP_BLOCK, ONE_TILE, GATHER)
    slice_idx, offs_n, span_end = _column_span(tl.program_id(1), end0, end1, end2, tile_start1, tile_start2, n_steps,
                                               BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    # 0 for the grid's slack past the last tile, an empty slot, or an untargeted slice
    rank = tl.load(ranks_ptr + slot * stride_ranks_slot + slice_idx, mask=slot >= 0, other=0)
    r_mask = offs_r < rank
    b_ptrs = b_ptr + slot.to(tl.int64) * stride_b_slot + offs_r[:, None] * stride_b_rank + offs_n[None, :] * stride_bn
    if PREFETCH_B:  # [BLOCK_R, BLOCK_N] tile of stack.b (Bᵀ) of the first step
        b = tl.load(b_ptrs, mask=r_mask[:, None] & (offs_n < span_end)[None, :], other=0.0)
    pdl.wait_for_inputs(PDL)
    if PIPELINE:  # plain column steps: the compiler's pipeliner streams out and B tiles through shared memory
        if rank == 0:  # out is never written
            return
        pdl.start_dependents(PDL)
        _pipelined_steps(y_ptr, b_ptr, out_ptr, rows, m_mask, slot, slice_idx, rank, max_rank, offs_n, span_end,
                         n_steps, stride_y_split, stride_ym, stride_y_slice, stride_y_rank, stride_b_slot, stride_b_rank,
                         stride_bn, stride_om, stride_on, BLOCK_M, BLOCK_N, BLOCK_R, RANK_CLASSES, SPLIT, DOT_PRECISION,
                         STAGES)
    else:
        # y and the first out tile do not need the rank: they are requested before branching on it
        # (branching first cost 1 us on 1-32-token expands on an H200).
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
            b_ptrs += BLOCK_N * stride_bn
            out_ptrs += BLOCK_N * stride_on
        for _ in range(1 if PREFETCH_B else 0, n_steps):
            n_mask = offs_n < span_end
            nxt = _next_out_tile(out_ptrs, offs_n, span_end, m_mask, BLOCK_N, stride_on)
            b = tl.load(b_ptrs, mask=r_mask[:, None] & n_mask[None, :], other=0.0)
            _add_product(out_ptrs, prev, y, b, m_mask[:, None] & n_mask[None, :], BLOCK_M, DOT_PRECISION)
            prev = nxt
            offs_n += BLOCK_N
            b_ptrs += BLOCK_N * stride_bn
            out_ptrs += BLOCK_N * stride_on


@triton.jit(**_PER_STEP)
def _stationary_kernel(
    y_ptr, b_ptr, out_ptr, ranks_ptr, starts_ptr, lens_ptr, slots_ptr, rows_ptr,
    num_groups, end0, end1, end2, tile_start1, tile_start2, n_steps, max_rank,
    stride_y_split, stride_ym, stride_y_slice, stride_y_rank,
    stride_b_slot, stride_b_rank, stride_bn,
    stride_om, stride_on,
    stride_ranks_slot,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, SPLIT: tl.constexpr,
    GROUP_BLOCK: tl.constexpr, ONE_TILE: tl.constexpr, GATHER: tl.constexpr, DOT_PRECISION: tl.constexpr,
    M_STEPS: tl.constexpr, STAGES: tl.constexpr, RANK_CLASSES: tl.constexpr, PDL: tl.constexpr,
):
    # B-stationary expand (`_stationary_steps`). grid: (N-tile, M-tile of M_STEPS tiles of BLOCK_M rows), so that
    # a wave of programs covers a band of rows across all columns (M first took 1.02x longer on an H200).
    slot, pos_begin, pos_end = _find_span(tl.program_id(1), starts_ptr, lens_ptr, slots_ptr, num_groups,
                                          BLOCK_M * M_STEPS, GROUP_BLOCK, ONE_TILE)
    slice_idx, offs_n, span_end = _column_span(tl.program_id(0), end0, end1, end2, tile_start1, tile_start2, n_steps,
                                               BLOCK_N)
    rank = tl.load(ranks_ptr + slot * stride_ranks_slot + slice_idx, mask=slot >= 0, other=0)
    _stationary_steps(y_ptr, b_ptr, out_ptr, rows_ptr, slot, pos_begin, pos_end, slice_idx, rank, max_rank, offs_n,
                      span_end, stride_y_split, stride_ym, stride_y_slice, stride_y_rank, stride_b_slot, stride_b_rank,
                      stride_bn, stride_om, stride_on, BLOCK_M, BLOCK_N, BLOCK_R, M_STEPS, RANK_CLASSES, SPLIT, GATHER,
                      DOT_PRECISION, STAGES, PDL)


@triton.jit
def _column_span(pid_n, end0, end1, end2, tile_start1, tile_start2, n_steps, BLOCK_N: tl.constexpr):
    """(slice, first BLOCK_N columns, end column) of N-tile pid_n. N-tiles run through slice 0, then 1, then 2,
    and slice s spans columns [end_{s-1}, end_s) of out (end_{-1} = 0)."""
    in1 = pid_n >= tile_start1
    in2 = pid_n >= tile_start2
    slice_idx = in1.to(tl.int32) + in2.to(tl.int32)
    n_begin = tl.where(in2, end1, tl.where(in1, end0, 0))
    n_end = tl.where(in2, end2, tl.where(in1, end1, end0))
    span_begin = n_begin + (pid_n - tl.where(in2, tile_start2, tl.where(in1, tile_start1, 0))) * (BLOCK_N * n_steps)
    span_end = tl.minimum(n_end, span_begin + BLOCK_N * n_steps)  # this program's columns
    return slice_idx, span_begin + tl.arange(0, BLOCK_N), span_end


@triton.jit
def _pipelined_steps(y_ptr, b_ptr, out_ptr, rows, m_mask, slot, slice_idx, rank, max_rank, offs_n, span_end,
                     n_steps, stride_y_split, stride_ym, stride_y_slice, stride_y_rank, stride_b_slot, stride_b_rank,
                     stride_bn, stride_om, stride_on, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, R: tl.constexpr,
                     CLASSES: tl.constexpr, SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr, STAGES: tl.constexpr):
    """out[rows, this program's columns] += y[rows, :rank] @ B[:rank, columns], in column steps whose out and
    B tiles the compiler prefetches STAGES - 1 steps ahead through shared memory (a loop's own num_stages
    pipelines every load in it; the kernel's, only tl.dot's operands). The steps multiply the narrowest of
    CLASSES rank tiles (R, R/2, R/4) holding the adapter's rank: in a mixed batch, a low-rank adapter's
    programs multiply (and hold) a fraction of the batch's rank tile."""
    if CLASSES > 1 and rank <= R // 2:
        _pipelined_steps(y_ptr, b_ptr, out_ptr, rows, m_mask, slot, slice_idx, rank, max_rank, offs_n, span_end,
                         n_steps, stride_y_split, stride_ym, stride_y_slice, stride_y_rank, stride_b_slot, stride_b_rank,
                         stride_bn, stride_om, stride_on, BLOCK_M, BLOCK_N, R // 2, CLASSES - 1, SPLIT, DOT_PRECISION,
                         STAGES)
    else:
        _pipelined_columns(y_ptr, b_ptr, out_ptr, rows, m_mask, slot, slice_idx, rank, max_rank, offs_n, span_end,
                           n_steps, stride_y_split, stride_ym, stride_y_slice, stride_y_rank, stride_b_slot,
                           stride_b_rank, stride_bn, stride_om, stride_on, BLOCK_M, BLOCK_N, R, SPLIT, DOT_PRECISION,
                           STAGES)


@triton.jit
def _pipelined_columns(y_ptr, b_ptr, out_ptr, rows, m_mask, slot, slice_idx, rank, max_rank, offs_n, span_end,
                       n_steps, stride_y_split, stride_ym, stride_y_slice, stride_y_rank, stride_b_slot, stride_b_rank,
                       stride_bn, stride_om, stride_on, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, R: tl.constexpr,
                       SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr, STAGES: tl.constexpr):
    """_pipelined_steps with a rank tile of R >= rank."""
    offs_r = tl.arange(0, R)
    r_mask = offs_r < rank
    y = tl.where(r_mask[None, :], _y_tile(y_ptr, rows, m_mask, slice_idx, offs_r, max_rank, stride_y_split, stride_ym,
                                          stride_y_slice, stride_y_rank, SPLIT, BLOCK_M), 0.0)
    b_ptrs = b_ptr + slot.to(tl.int64) * stride_b_slot + offs_r[:, None] * stride_b_rank + offs_n[None, :] * stride_bn
    out_ptrs = out_ptr + rows[:, None] * stride_om + offs_n[None, :] * stride_on
    for _ in tl.range(0, n_steps, num_stages=STAGES):
        n_mask = offs_n < span_end
        mask = m_mask[:, None] & n_mask[None, :]
        prev = tl.load(out_ptrs, mask=mask, other=0.0)
        b = tl.load(b_ptrs, mask=r_mask[:, None] & n_mask[None, :], other=0.0)
        acc = _matmul(y, b, prev.to(tl.float32), BLOCK_M, DOT_PRECISION)
        tl.store(out_ptrs, acc.to(out_ptrs.dtype.element_ty), mask=mask)
        offs_n += BLOCK_N
        b_ptrs += BLOCK_N * stride_bn
        out_ptrs += BLOCK_N * stride_on


@triton.jit
def _stationary_steps(y_ptr, b_ptr, out_ptr, rows_ptr, slot, pos_begin, pos_end, slice_idx, rank, max_rank, offs_n,
                      span_end, stride_y_split, stride_ym, stride_y_slice, stride_y_rank, stride_b_slot, stride_b_rank,
                      stride_bn, stride_om, stride_on, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, R: tl.constexpr,
                      M_STEPS: tl.constexpr, CLASSES: tl.constexpr, SPLIT: tl.constexpr, GATHER: tl.constexpr,
                      DOT_PRECISION: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr):
    """out[positions pos_begin..pos_end of the group, this program's columns] += y @ B[:rank, columns], B's tile
    read once (before the PDL wait), then M-tile after M-tile, each tile's y and out loads prefetched
    STAGES - 1 tiles ahead. The rank tile is the narrowest of CLASSES (R, R/2, R/4) holding the adapter's rank,
    as in `_pipelined_steps`."""
    if CLASSES > 1 and rank <= R // 2:
        _stationary_steps(y_ptr, b_ptr, out_ptr, rows_ptr, slot, pos_begin, pos_end, slice_idx, rank, max_rank, offs_n,
                          span_end, stride_y_split, stride_ym, stride_y_slice, stride_y_rank, stride_b_slot,
                          stride_b_rank, stride_bn, stride_om, stride_on, BLOCK_M, BLOCK_N, R // 2, M_STEPS,
                          CLASSES - 1, SPLIT, GATHER, DOT_PRECISION, STAGES, PDL)
    else:
        offs_r = tl.arange(0, R)
        r_mask = offs_r < rank
        n_mask = offs_n < span_end
        b = tl.load(b_ptr + slot.to(tl.int64) * stride_b_slot + offs_r[:, None] * stride_b_rank
                    + offs_n[None, :] * stride_bn, mask=r_mask[:, None] & n_mask[None, :], other=0.0)
        steps = tl.arange(0, M_STEPS)[:, None]
        if GATHER:  # every step's rows at once: loads in the loop whose address came from a load there (the
            #         rows) were not prefetched, and such expands ran 1.4x slower on an H200
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
                # Not masked by the rank: lora_shrink wrote zeros there (a masked load or a select cost 1.1x
                # on an H200: the tile then passes through registers instead of straight to the product).
                y = _y_tile(y_ptr, rows, m_mask, slice_idx, offs_r, max_rank, stride_y_split, stride_ym,
                            stride_y_slice, stride_y_rank, SPLIT, BLOCK_M)
                out_ptrs = out_ptr + rows[:, None] * stride_om + offs_n[None, :] * stride_on
                mask = m_mask[:, None] & n_mask[None, :]
                prev = tl.load(out_ptrs, mask=mask, other=0.0)
                acc = _matmul(y, b, prev.to(tl.float32), BLOCK_M, DOT_PRECISION)
                tl.store(out_ptrs, acc.to(out_ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _y_tile(y_ptr, rows, m_mask, slice_idx, offs_r, max_rank, stride_y_split, stride_ym, stride_y_slice, stride_y_rank,
            SPLIT: tl.constexpr, BLOCK_M: tl.constexpr):
    """y[rows, slice, offs_r] summed over its planes (`_sum_of_planes`); columns past the stack's padded rank read as 0
    (a host int: the loads stay vectorized), those past the adapter's own rank are the caller's to mask."""
    y_ptrs = y_ptr + rows[:, None] * stride_ym + slice_idx * stride_y_slice + offs_r[None, :] * stride_y_rank
    y_mask = m_mask[:, None] & (offs_r < max_rank)[None, :]
    return _sum_of_planes(y_ptrs, y_mask, stride_y_split, SPLIT, BLOCK_M)


@triton.jit
def _sum_of_planes(y_ptrs, y_mask, stride_y_split, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr):
    """The sum of y's SPLIT planes at `y_ptrs` (plane 0), as a [BLOCK_M, ranks] tile: float32, or y's own
    dtype when it has one plane. Tiles of 16+ rows load plane after plane (independent loads, all in flight
    at once): one [SPLIT, BLOCK_M, ranks] load holds SPLIT times the registers. A 1-row tile loads all
    planes at once: loaded one by one, 32 planes made a decode expand 4-7x slower on an H200."""
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
    delta = _matmul(y, b, tl.zeros((y.shape[0], b.shape[1]), dtype=tl.float32), BLOCK_M, DOT_PRECISION)
    tl.store(out_ptrs, (prev.to(tl.float32) + delta).to(out_ptrs.dtype.element_ty), mask=mask)
