"""One-launch merge and restore over many weights (kernels/merge.py holds the contract).

A task is one output slice of one weight: merge writes the slice's old rows to the backup and adds
scaling · B @ A to them (a slice the adapter does not target is a task of rank 0: saved, left as it
is, so that a restore can copy whole weights). Both kernels are streams over HBM, so they are
written for bandwidth:

- every program is one independent [block_n, block_k] tile of W (a 7B's q,k,v,o at 64 x 128: 262k
  programs), so that many tiles' loads are in flight on every SM;
- a program finds its task in one load: `program_tasks[pid]` (tasks' tiles laid end to end), then
  the task's record (int64: the arena's address and where the slice's column of each slot table
  is; the slot's A and Bᵀ offsets, rank and scaling are read from those tables on the device), so
  the launch description is built on the host once per set of targets and serves every slot, every
  adapter loaded into it and wherever a compaction moved it; tile t of a task is row block
  t // k_tiles, column block t % k_tiles, so consecutive programs sweep whole rows;
- the W tile's load is issued first (evict_first: streamed once) and overlaps the loads of the B
  [block_n, r] and A [r, block_k] tiles (evict_last: L2-resident, shared by the task's tiles) and
  the one tl.dot (float32 accumulation); then two stores. A rank-0 task only stores the backup;
- addresses and row strides come from memory, so the compiler cannot prove 16-byte alignment and
  would move 2 bytes per instruction: when the host finds every address and stride aligned it
  says so (ALIGNED) and the kernel passes the hints that give 16-byte vector loads and stores (arena
  offsets are multiples of kernels.adapter_arena.ALIGN elements by construction).

Restore copies every backup back, `block` elements a program, found the same way.

Example, block 64 x 128, two tasks: q [4096 rows, 4096] (rank 64) then k [512, 4096] (rank 0):
k_tiles = 32; q has 64 row blocks = 2048 tiles (pids 0..2047), k 8 row blocks = 256 tiles
(pids 2048..2303); program_tasks = [0]*2048 + [1]*256; pid 2100 is k's tile 52: rows 64..127,
columns 2560..2687, saved to the backup and left as they are.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch
import triton
import triton.language as tl

from kernels.merge import MergeTarget
from kernels.triton.compile_ahead import launcher

_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
_VECTOR_BYTES = 16  # widest global load/store


@dataclass(frozen=True)
class MergeConfig:
    """Launch shape of the merge kernel: one [block_n, block_k] tile of W per program (no loop, so
    no pipeline stages to choose). Blocks are powers of two >= 16 (tl.dot)."""
    block_n: int
    block_k: int
    num_warps: int

    def __post_init__(self) -> None:
        for block in (self.block_n, self.block_k):
            assert block >= 16 and block & (block - 1) == 0, self
        assert self.num_warps in (1, 2, 4, 8, 16), self


@dataclass(frozen=True)
class RestoreConfig:
    """Launch shape of the restore copy: `block` contiguous elements per program (a power of two)."""
    block: int
    num_warps: int

    def __post_init__(self) -> None:
        assert self.block >= 128 and self.block & (self.block - 1) == 0, self
        assert self.num_warps in (1, 2, 4, 8, 16), self


# 16-bit: a 64 x 128 tile (16 KB of W) on 4 warps needs 162 registers, so 3 programs share an SM
# with 48 KB of W loads in flight, no spills (ptxas, sm_90a). float32 takes the exact product on
# CUDA cores (input_precision "ieee"), whose 64 x 128 tile spills: 32 x 64 on 8 warps does not.
MERGE_CONFIGS = {2: MergeConfig(block_n=64, block_k=128, num_warps=4),  # by element size
                 4: MergeConfig(block_n=32, block_k=64, num_warps=8)}
# 128 KB of bf16 a program, 16 B a load: a sweep's best (docs/benchmarks/merge.md).
RESTORE_CONFIG = RestoreConfig(block=65536, num_warps=16)


def merge_weights_triton(targets: Sequence[MergeTarget], slot: int, config: MergeConfig | None = None,
                         compile_only: bool = False) -> None:
    """config: None = MERGE_CONFIGS for the weights' element size. compile_only: compile the kernel
    these targets select without launching it (kernels.warm_up_merge)."""
    if not targets:
        return
    config = config or MERGE_CONFIGS[targets[0].weight.element_size()]
    launch = _merge_launch(tuple(targets), config)
    launcher(_merge_kernel, (launch.num_programs,), compile_only)(
        launch.program_tasks, launch.records, slot,
        DTYPE=launch.dtype, BLOCK_N=config.block_n, BLOCK_K=config.block_k, BLOCK_R=launch.block_r,
        ALIGNED=launch.aligned, VECTOR=launch.vector, num_warps=config.num_warps)


def restore_weights_triton(targets: Sequence[MergeTarget], config: RestoreConfig = RESTORE_CONFIG,
                           compile_only: bool = False) -> None:
    if not targets:
        return
    launch = _restore_launch(tuple(targets), config)
    launcher(_restore_kernel, (launch.num_programs,), compile_only)(
        launch.program_tasks, launch.records,
        DTYPE=launch.dtype, BLOCK=config.block, ALIGNED=launch.aligned, VECTOR=launch.vector,
        num_warps=config.num_warps)


@dataclass(frozen=True)
class _Launch:
    """What a launch over a set of targets needs besides the slot, built once per set (cached)."""
    program_tasks: torch.Tensor  # int32 [num_programs]: the task (record) of each program
    records: torch.Tensor        # int64 [num_tasks * record size], the kernel's record layout
    num_programs: int
    dtype: tl.dtype
    aligned: bool                # every address and stride a multiple of 16 bytes
    vector: int                  # elements in 16 bytes
    block_r: int = 0             # merge: the rank tile (the stacks' max rank, rounded up to a power of 2)


def _checked_dtype_device(targets: tuple[MergeTarget, ...]) -> tuple[torch.dtype, torch.device, int]:
    dtype, device = targets[0].weight.dtype, targets[0].weight.device
    for t in targets:
        assert t.weight.dtype == t.backup.dtype == t.stack.dtype == dtype, "one dtype per launch"
        assert t.weight.device == t.backup.device == t.stack.device == device, "one device per launch"
        assert t.weight.is_contiguous() and t.backup.is_contiguous() and t.backup.shape == t.weight.shape
    return dtype, device, targets[0].weight.element_size()


# Keyed by the targets' identity (MergeTarget compares by identity and holds its tensors, so a
# cached address cannot outlive its tensor): a worker merges the same projections every time, and
# building the records in Python costs ~0.3 ms that the idle GPU would wait for.
@lru_cache(maxsize=8)
def _merge_launch(targets: tuple[MergeTarget, ...], config: MergeConfig) -> _Launch:
    """Records hold the addresses of the arena and of the slice's entry of slot 0 in each table, and the
    kernel reads the slot's entries: one launch description serves every slot and every adapter loaded
    into it, wherever it lies in the arena."""
    dtype, device, elem = _checked_dtype_device(targets)
    records, tiles, num_programs, block_r, address_bits = array("q"), [], 0, 16, 0
    for target in targets:
        stack = target.stack
        out_features, in_features = target.weight.shape
        assert (out_features, in_features) == (stack.out_features, stack.in_features), (target.weight.shape,)
        row_bytes, k_tiles = in_features * elem, -(-in_features // config.block_k)
        w_rows, backup_rows, arena = target.weight.data_ptr(), target.backup.data_ptr(), stack.arena.data.data_ptr()
        address_bits |= w_rows | backup_rows | arena | row_bytes
        block_r = max(block_r, 1 << (stack.max_rank - 1).bit_length())
        tables = [(t.data_ptr(), t.element_size()) for t in (stack.a_offsets, stack.b_offsets, stack.scalings,
                                                              stack.ranks)]  # [slots, slices], contiguous
        for s in range(stack.num_slices):
            first, rows = stack.out_offsets[s], stack.out_offsets[s + 1] - stack.out_offsets[s]
            address_bits |= rows * elem  # Bᵀ's row stride
            records.extend((w_rows + first * row_bytes, backup_rows + first * row_bytes, arena,
                            *(table + s * size for table, size in tables), stack.num_slices,
                            rows, in_features, num_programs))
            tiles.append(-(-rows // config.block_n) * k_tiles)
            num_programs += tiles[-1]
    return _Launch(_program_tasks(tuple(tiles), device), torch.frombuffer(records, dtype=torch.int64).to(device),
                   num_programs, _TL_DTYPES[dtype], address_bits % _VECTOR_BYTES == 0, _VECTOR_BYTES // elem, block_r)


@lru_cache(maxsize=8)
def _restore_launch(targets: tuple[MergeTarget, ...], config: RestoreConfig) -> _Launch:
    dtype, device, elem = _checked_dtype_device(targets)
    records, chunks, num_programs, address_bits = array("q"), [], 0, 0
    for t in targets:
        weight, backup, numel = t.weight.data_ptr(), t.backup.data_ptr(), t.weight.numel()
        records.extend((weight, backup, numel, num_programs))
        chunks.append(-(-numel // config.block))
        num_programs += chunks[-1]
        address_bits |= weight | backup | numel * elem
    return _Launch(_program_tasks(tuple(chunks), device), torch.frombuffer(records, dtype=torch.int64).to(device),
                   num_programs, _TL_DTYPES[dtype], address_bits % _VECTOR_BYTES == 0, _VECTOR_BYTES // elem)


def _program_tasks(programs_per_task: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """int32 [sum(programs_per_task)]: the task of each program (about 1 MB for a 7B's q,k,v,o)."""
    counts = torch.tensor(programs_per_task, dtype=torch.int64)
    return torch.repeat_interleave(torch.arange(len(counts), dtype=torch.int32), counts).to(device)


@triton.jit(do_not_specialize=["slot"])  # one compiled kernel for every slot
def _merge_kernel(program_tasks, records, slot,
                  DTYPE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
                  ALIGNED: tl.constexpr, VECTOR: tl.constexpr):
    pid = tl.program_id(0)
    record = records + tl.load(program_tasks + pid).to(tl.int64) * 11  # the host's record layout
    w_rows = tl.load(record + 0).to(tl.pointer_type(DTYPE))
    backup_rows = tl.load(record + 1).to(tl.pointer_type(DTYPE))
    arena = tl.load(record + 2).to(tl.pointer_type(DTYPE))
    entry = slot.to(tl.int64) * tl.load(record + 7)  # the slot's row of the [slots, slices] tables
    a_offset_ptr = tl.load(record + 3).to(tl.pointer_type(tl.int64)) + entry
    b_offset_ptr = tl.load(record + 4).to(tl.pointer_type(tl.int64)) + entry
    scaling_ptr = tl.load(record + 5).to(tl.pointer_type(tl.float32)) + entry
    rank_ptr = tl.load(record + 6).to(tl.pointer_type(tl.int32)) + entry
    num_rows = tl.load(record + 8).to(tl.int32)
    in_features = tl.load(record + 9).to(tl.int32)
    tile = pid - tl.load(record + 10).to(tl.int32)
    if ALIGNED:  # the host checked: every address 16-byte aligned, strides multiples of VECTOR elements
        w_rows = tl.multiple_of(w_rows, 16)
        backup_rows = tl.multiple_of(backup_rows, 16)
        in_features = tl.multiple_of(in_features, VECTOR)
        num_rows = tl.multiple_of(num_rows, VECTOR)  # Bᵀ's row stride, and masks its contiguous axis: 16 B loads
    k_tiles = tl.cdiv(in_features, BLOCK_K)
    offs_n = (tile // k_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)   # rows of the task's slice
    offs_k = (tile % k_tiles) * BLOCK_K + tl.arange(0, BLOCK_K)    # columns
    n_mask, k_mask = offs_n < num_rows, offs_k < in_features
    w_offs = offs_n[:, None].to(tl.int64) * in_features + offs_k[None, :]
    w_mask = n_mask[:, None] & k_mask[None, :]
    w = tl.load(w_rows + w_offs, mask=w_mask, eviction_policy="evict_first")  # [BLOCK_N, BLOCK_K], in flight
    # The slot's table entries, after W's load is issued (nothing of it depends on them).
    rank = tl.load(rank_ptr)
    a_ptr = arena + tl.load(a_offset_ptr)  # A_s [rank, in_features]
    b_ptr = arena + tl.load(b_offset_ptr)  # B_sᵀ [rank, num_rows]
    if ALIGNED:  # arena offsets are multiples of ALIGN elements
        a_ptr = tl.multiple_of(a_ptr, 16)
        b_ptr = tl.multiple_of(b_ptr, 16)
    if rank > 0:  # 0: the slot's adapter does not target this slice (saved, left as it is)
        offs_r = tl.arange(0, BLOCK_R)
        b = tl.load(b_ptr + offs_r[None, :].to(tl.int64) * num_rows + offs_n[:, None],
                    mask=n_mask[:, None] & (offs_r < rank)[None, :], other=0.0,
                    eviction_policy="evict_last")                                  # [BLOCK_N, BLOCK_R] of Bᵀ's rows
        a = tl.load(a_ptr + offs_r[:, None].to(tl.int64) * in_features + offs_k[None, :],
                    mask=(offs_r < rank)[:, None] & k_mask[None, :], other=0.0,
                    eviction_policy="evict_last")                                  # [BLOCK_R, BLOCK_K]
        # 16-bit products are exact in float32, so tensor cores with float32 accumulation compute
        # what a float32 matmul would; float32 weights take the exact (non-tf32) path.
        delta = tl.dot(b, a, input_precision="ieee" if DTYPE == tl.float32 else "tf32") * tl.load(scaling_ptr)
        tl.store(w_rows + w_offs, (w.to(tl.float32) + delta).to(DTYPE), mask=w_mask, eviction_policy="evict_first")
    tl.store(backup_rows + w_offs, w, mask=w_mask, eviction_policy="evict_first")


@triton.jit
def _restore_kernel(program_tasks, records, DTYPE: tl.constexpr, BLOCK: tl.constexpr,
                    ALIGNED: tl.constexpr, VECTOR: tl.constexpr):
    pid = tl.program_id(0)
    record = records + tl.load(program_tasks + pid).to(tl.int64) * 4  # weight, backup, numel, first chunk
    weight = tl.load(record + 0).to(tl.pointer_type(DTYPE))
    backup = tl.load(record + 1).to(tl.pointer_type(DTYPE))
    numel = tl.load(record + 2)
    chunk = pid - tl.load(record + 3)
    if ALIGNED:
        weight = tl.multiple_of(weight, 16)
        backup = tl.multiple_of(backup, 16)
        numel = tl.multiple_of(numel, VECTOR)
    offs = chunk * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    mask = offs < numel
    tl.store(weight + offs, tl.load(backup + offs, mask=mask, eviction_policy="evict_first"), mask=mask)
