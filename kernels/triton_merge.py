"""One-launch merge and restore over many weights (see kernels/merge.py for the contract).

A task is one output slice of one weight: merge writes the slice's old rows to the backup and adds
scaling · B @ A to them (a slice the adapter does not target is a task of rank 0: saved, left
as it is, so that a restore can copy whole weights). Every row block of every task is one program: the
host passes, per task, the addresses of its weight rows, backup rows, A, B and scaling (int64),
its row count, rank, in_features and the B row stride, and the cumulative row-block counts; a
program finds its task by binary search over those. Tiles are [BLOCK_N rows, BLOCK_K columns] of W; the
delta tile is B[BLOCK_N, r] @ A[r, BLOCK_K] accumulated in float32, r padded to BLOCK_R (>= 16) and masked.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from kernels.merge import MergeTarget

BLOCK_N, BLOCK_K = 64, 128
COPY_BLOCK = 4096
_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def merge_weights_triton(targets: Sequence[MergeTarget], slot: int) -> None:
    if not targets:
        return
    ptrs, sizes, tile_starts = [], [], [0]
    for target in targets:
        stack, weight, backup = target.stack, target.weight, target.backup
        assert weight.is_contiguous() and backup.is_contiguous() and backup.shape == weight.shape
        in_features = weight.shape[1]
        for s, rank in enumerate(stack.host_ranks[slot]):
            first, stop = stack.out_offsets[s], stack.out_offsets[s + 1]
            ptrs.append([weight[first].data_ptr(), backup[first].data_ptr(), stack.a[slot, s].data_ptr(),
                         stack.b[slot, first].data_ptr(), stack.scalings[slot:slot + 1].data_ptr()])
            sizes.append([stop - first, rank, in_features, stack.max_rank])
            tile_starts.append(tile_starts[-1] + triton.cdiv(stop - first, BLOCK_N))
    dtype = targets[0].weight.dtype
    assert all(t.weight.dtype == dtype for t in targets), "one dtype per launch"
    device = targets[0].weight.device
    max_rank = max(t.stack.max_rank for t in targets)
    _merge_kernel[(tile_starts[-1],)](
        torch.tensor(ptrs, dtype=torch.int64).to(device), torch.tensor(sizes, dtype=torch.int32).to(device),
        torch.tensor(tile_starts, dtype=torch.int32).to(device), len(ptrs),
        DTYPE=_TL_DTYPES[dtype], BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        BLOCK_R=max(16, triton.next_power_of_2(max_rank)), num_warps=8, num_stages=3)


def restore_weights_triton(targets: Sequence[MergeTarget]) -> None:
    if not targets:
        return
    assert all(t.weight.is_contiguous() and t.backup.is_contiguous() and t.weight.shape == t.backup.shape
               for t in targets)
    device = targets[0].weight.device
    ptrs = torch.tensor([[t.weight.data_ptr(), t.backup.data_ptr()] for t in targets], dtype=torch.int64).to(device)
    numels = [t.weight.numel() for t in targets]
    _restore_kernel[(len(targets), triton.cdiv(max(numels), COPY_BLOCK))](
        ptrs, torch.tensor(numels, dtype=torch.int64).to(device),
        DTYPE=_TL_DTYPES[targets[0].weight.dtype], BLOCK=COPY_BLOCK, num_warps=4)


@triton.jit
def _merge_kernel(ptrs, sizes, tile_starts, num_tasks,
                  DTYPE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr):
    pid = tl.program_id(0)
    lo: tl.int32 = 0            # the task holding tile pid: the last t with tile_starts[t] <= pid
    hi: tl.int32 = num_tasks
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if tl.load(tile_starts + mid) <= pid:
            lo = mid
        else:
            hi = mid
    task = lo
    tile = pid - tl.load(tile_starts + task)
    w_rows = tl.load(ptrs + task * 5).to(tl.pointer_type(DTYPE))
    backup_rows = tl.load(ptrs + task * 5 + 1).to(tl.pointer_type(DTYPE))
    a_ptr = tl.load(ptrs + task * 5 + 2).to(tl.pointer_type(DTYPE))
    b_ptr = tl.load(ptrs + task * 5 + 3).to(tl.pointer_type(DTYPE))
    scaling = tl.load(tl.load(ptrs + task * 5 + 4).to(tl.pointer_type(tl.float32)))
    num_rows = tl.load(sizes + task * 4)
    rank = tl.load(sizes + task * 4 + 1)
    in_features = tl.load(sizes + task * 4 + 2)
    b_stride = tl.load(sizes + task * 4 + 3)

    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)   # this program's rows of the task's slice
    offs_r = tl.arange(0, BLOCK_R)
    n_mask, r_mask = offs_n < num_rows, offs_r < rank
    b = tl.load(b_ptr + offs_n[:, None].to(tl.int64) * b_stride + offs_r[None, :],
                mask=n_mask[:, None] & r_mask[None, :], other=0.0)          # [BLOCK_N, BLOCK_R], read once
    row_offs = offs_n[:, None].to(tl.int64) * in_features
    for k0 in range(0, in_features, BLOCK_K):  # stream the rows across K
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < in_features
        a = tl.load(a_ptr + offs_r[:, None] * in_features + offs_k[None, :],
                    mask=r_mask[:, None] & k_mask[None, :], other=0.0)      # [BLOCK_R, BLOCK_K]
        # 16-bit products are exact in float32, so tensor cores with float32 accumulation compute
        # what a float32 matmul would; float32 weights take the exact (non-tf32) path.
        delta = tl.dot(b, a, input_precision="ieee" if DTYPE == tl.float32 else "tf32") * scaling
        w_offs = row_offs + offs_k[None, :]
        mask = n_mask[:, None] & k_mask[None, :]
        w = tl.load(w_rows + w_offs, mask=mask)
        tl.store(backup_rows + w_offs, w, mask=mask)
        tl.store(w_rows + w_offs, (w.to(tl.float32) + delta).to(DTYPE), mask=mask)


@triton.jit
def _restore_kernel(ptrs, sizes, DTYPE: tl.constexpr, BLOCK: tl.constexpr):
    pair = tl.program_id(0)
    offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < tl.load(sizes + pair)
    weight = tl.load(ptrs + pair * 2).to(tl.pointer_type(DTYPE))
    backup = tl.load(ptrs + pair * 2 + 1).to(tl.pointer_type(DTYPE))
    tl.store(weight + offs, tl.load(backup + offs, mask=mask), mask=mask)
