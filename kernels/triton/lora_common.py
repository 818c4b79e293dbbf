"""What the LoRA shrink and expand kernels share: how a program finds its M-tile, and the host
values that pick a compiled variant.

One program per (M-tile of a group, ...) in both ops. A group is every token of one adapter slot
(kernels/batch.py), so an adapter's weights are read once per tile of its tokens however its
requests interleave; when its tokens are scattered, the program gathers its rows through the
batch's row order. The grid's M axis counts tiles of the whole batch rather than (groups x largest
group): with a 2048-token prefill beside 255 decode groups the latter would launch ~8000 M
programs where ~290 have work. Each program finds its group with a prefix sum over the groups'
tile counts (`find_tile`, one read of the batch's small int32 metadata), then returns at once when
its slice is untargeted or its slot empty.

Grids come from host ints only (num_tokens, the batch's capacity, the stack's shape;
max_group_len only picks the configuration), and every per-step value is read from device
tensors (the batch's groups, the slot tables, the arena), so both ops can be captured in a CUDA
graph and replayed with new batch and slot contents, adapters loaded, moved or freed. Tile shapes come from the offline-tuned table (kernels/tiling.py), by shape bucket.

Under PDL (kernels/triton/pdl.py) both kernels read the batch metadata, the slot's table entries
(rank and arena offset, loaded together) and their first weight tile before waiting on the kernel
launched just before them: that kernel must not write the arena, the stack's tables or the batch's
device tensors. The engine loads adapters and copies batches in between steps.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.batch import LoRABatch
from kernels.lora_stack import LoRAStack


def rank_tile(stack: LoRAStack, batch: LoRABatch) -> int:
    """Rank tile: every rank the batch may use at once; columns >= a slice's rank are masked."""
    return max(16, triton.next_power_of_2(batch.rank_bound(stack.max_rank)))


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 models get exact fp32 products (tf32 would lose 13 mantissa bits); 16-bit inputs
    # ignore the setting.
    return "ieee" if dtype == torch.float32 else "tf32"


def one_tile_per_group(batch: LoRABatch, block_m: int) -> bool:
    """Decode-like batches: M-tile i is group i, and programs need not search for their tile."""
    return batch.max_group_len <= block_m


def m_tile_bound(batch: LoRABatch, block_m: int) -> int:
    """Host bound on the M-tiles of all groups: each group adds at most one partial tile."""
    if one_tile_per_group(batch, block_m):
        return batch.capacity
    return triton.cdiv(batch.num_tokens, block_m) + min(batch.capacity, batch.num_tokens)


def group_block(capacity: int) -> int:
    """Groups each program scans to find its tile (metadata read, no weights); at least 64 so
    that batches of up to 64 adapters share one compiled kernel."""
    return max(64, triton.next_power_of_2(capacity))


def is_pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def rows_arg(x: torch.Tensor, batch: LoRABatch) -> torch.Tensor:
    return x if batch.rows is None else batch.rows  # any tensor: GATHER=False never reads it


@triton.jit
def find_tile(starts_ptr, lens_ptr, slots_ptr, rows_ptr, num_groups,
              BLOCK_M: tl.constexpr, GROUP_BLOCK: tl.constexpr, ONE_TILE: tl.constexpr,
              GATHER: tl.constexpr):
    """(slot, token rows [BLOCK_M] int64, row mask) of this program's M-tile; slot -1: nothing to do."""
    slot, pos_begin, pos_end = find_span(tl.program_id(0), starts_ptr, lens_ptr, slots_ptr, num_groups, BLOCK_M,
                                         GROUP_BLOCK, ONE_TILE)
    rows, m_mask = tile_rows(rows_ptr, slot, pos_begin, pos_end, BLOCK_M, GATHER)
    return slot, rows, m_mask


@triton.jit
def find_span(pid, starts_ptr, lens_ptr, slots_ptr, num_groups, TILE_ROWS: tl.constexpr, GROUP_BLOCK: tl.constexpr,
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
def tile_rows(rows_ptr, slot, pos_begin, pos_end, BLOCK_M: tl.constexpr, GATHER: tl.constexpr):
    """(token rows [BLOCK_M] int64, row mask) of positions pos_begin.. (< pos_end) of a group."""
    pos = pos_begin + tl.arange(0, BLOCK_M)
    m_mask = pos < pos_end
    if GATHER:
        rows = tl.load(rows_ptr + pos, mask=m_mask & (slot >= 0), other=0)
    else:
        rows = pos
    return rows.to(tl.int64), m_mask


@triton.jit
def matmul(a, b, acc, BLOCK_M: tl.constexpr, DOT_PRECISION: tl.constexpr):
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
# compile another variant while serving (kernels/triton/lora_warmup.py).
PER_STEP = dict(do_not_specialize=["num_groups", "stride_y_split"],
                do_not_specialize_on_alignment=["starts_ptr", "lens_ptr", "slots_ptr", "rows_ptr"])
