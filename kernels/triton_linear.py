"""out = x @ Wᵀ (+ bias) for few rows (decode): one program per BLOCK_N output columns, K streamed.

The rows are padded to a 16-, 32- or 64-row tl.dot tile (tensor cores; the waste is free when
memory bound), and no program splits K, so no second reduction kernel runs (cuBLAS splits K for
the 4096-wide outputs at 17-64 rows and reduces in a second launch). Tile configurations come from
sweeps over the 7B projection shapes on an H200 (docs/benchmarks/skinny_gemm_sweep-2026-11-21-h200.log
for 16 rows, benchmarks/linear_bench.py for more).

With a LoRA operand the same kernel adds each token's adapter product to its tile before the one
store: out = x @ Wᵀ + bias + y @ B_slotᵀ, the expand of kernels/triton_lora.py fused into the base
matmul. At decode a separate expand reads and writes out again, and its tiny programs wait on
dependent metadata loads; here B streams after W in the same programs, each group a K step of
rank width (`_add_lora`). The delta is added in fp32 before out is rounded once.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.batch import LoRABatch
from kernels.lora_stack import LoRAStack
from kernels.triton_lora import group_block

MAX_ROWS = 64  # the most rows this kernel serves
# The fused expand visits its groups one after another in each program, while kernels.lora_expand
# spreads them over programs of their own. With every group one token long (each sequence on its own
# adapter), fusing paid up to 16 rows (a 7B decode step's matmuls and expands 1.11x faster at 8 rows,
# 1.08x at 16 on an H200) and did not at 32 (0.99x): past this many such groups the expand runs apart
# (docs/benchmarks/engine.md).
MAX_FUSED_ONE_TOKEN_GROUPS = 16
LORA_STAGES = tl.constexpr(4)  # B tiles in flight in the fused expand's group loop


@dataclass(frozen=True, eq=False)  # holds tensors: identity, not value, equality
class LoRAOperand:
    """What the fused expand adds: y from kernels.lora_shrink (float32 [splits, num_tokens,
    num_slices, max_rank]) times each group's B in `stack`, for the groups of `batch`."""
    y: torch.Tensor
    stack: LoRAStack
    batch: LoRABatch


@dataclass(frozen=True)
class LinearConfig:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def row_tile(num_rows: int) -> int:
    """Rows of the padded tile: 16 (tl.dot's minimum), 32 or 64."""
    assert 1 <= num_rows <= MAX_ROWS, num_rows
    return max(16, triton.next_power_of_2(num_rows))


def linear_config(num_rows: int, out_features: int, in_features: int) -> LinearConfig:
    """Wide outputs (gate_up, lm_head) have programs to spare: wider tiles, shorter K steps; narrow
    outputs (o) and long K (down) want long K steps to keep enough bytes in flight per program,
    as long as the stages of a taller row tile still fit in shared memory."""
    if out_features >= 16384:
        return LinearConfig(block_n=64, block_k=128, num_warps=4, num_stages=3)
    if in_features >= 8192 or out_features <= 4096:
        return LinearConfig(block_n=32, block_k=512 if row_tile(num_rows) == 16 else 256, num_warps=4, num_stages=4)
    if row_tile(num_rows) == 16:
        return LinearConfig(block_n=32, block_k=128, num_warps=4, num_stages=4)
    return LinearConfig(block_n=128, block_k=128, num_warps=4, num_stages=4)


def fuses_lora(stack: LoRAStack, batch: LoRABatch, config: LinearConfig | None = None) -> bool:
    """Whether skinny_linear should add this LoRA operand itself: not for many one-token groups
    (MAX_FUSED_ONE_TOKEN_GROUPS), and it can only where no column tile straddles two slices of a fused
    projection."""
    one_token_groups = batch.max_group_len <= 1 and batch.num_tokens > MAX_FUSED_ONE_TOKEN_GROUPS
    return not one_token_groups and _tiles_fit_slices(batch.num_tokens, stack, config)


def _tiles_fit_slices(num_rows: int, stack: LoRAStack, config: LinearConfig | None) -> bool:
    cfg = config or linear_config(num_rows, stack.out_features, stack.in_features)
    return 1 <= num_rows <= MAX_ROWS and all(offset % cfg.block_n == 0 for offset in stack.out_offsets[1:-1])


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  config: LinearConfig | None = None, lora: LoRAOperand | None = None,
                  compile_only: bool = False) -> torch.Tensor:
    """x: [M <= 64, K], weight: [N, K] (rows contiguous), bias: [N] or None -> [M, N] in x's dtype;
    plus, with `lora` (where fuses_lora, or past its row rule), out[t, slice s] += y.sum(0)[t, s, :r] @ stack.b[slot, :r, slice s]
    for the tokens of each group with a slot, as kernels.lora_expand adds it.
    compile_only: compile the kernel for these arguments without launching it (kernels/lora_warmup.py).

    Under PDL (kernels/pdl.py) a LoRA program streams W before waiting on the kernel launched just before
    it, which must therefore not write x, weight or bias: linear_with_lora launches the shrink there, which
    writes only y, and whose programs start this kernel only after they waited on x's writer themselves."""
    num_rows, in_features = x.shape
    out_features = weight.shape[0]
    assert weight.shape[1] == in_features and weight.stride(1) == 1, (x.shape, weight.shape)
    assert x.stride(1) == 1 and weight.dtype == x.dtype, (x.stride(), weight.dtype, x.dtype)
    assert bias is None or bias.shape == (out_features,), bias.shape
    block_m = row_tile(num_rows)
    cfg = config or linear_config(num_rows, out_features, in_features)
    out = torch.empty(num_rows, out_features, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(out_features, cfg.block_n),)
    kernel = functools.partial(_skinny_linear_kernel.warmup, grid=grid) if compile_only else _skinny_linear_kernel[grid]
    kernel(x, weight, bias if bias is not None else weight, out, num_rows, out_features, in_features,
           x.stride(0), weight.stride(0), out.stride(0), *_lora_args(out, weight, lora, cfg),
           HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
           DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
           num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.launch_options(x.device))
    return out


def _lora_args(out: torch.Tensor, weight: torch.Tensor, lora: LoRAOperand | None, cfg: LinearConfig) -> tuple:
    """The kernel's LoRA arguments, ending with its HAS_LORA, GATHER, GROUP_BLOCK, BLOCK_R and SPLIT
    constexprs; without an operand, placeholders the kernel never reads."""
    if lora is None:
        return (weight,) * 7 + (0,) * 10 + (False, False, 16, 16, 1)
    y, stack, batch = lora.y, lora.stack, lora.batch
    stack.check_expand_args(out, y, batch)
    assert stack.in_features == weight.shape[1] and stack.out_features == weight.shape[0], (stack.a.shape, weight.shape)
    assert _tiles_fit_slices(out.shape[0], stack, cfg) and stack.num_slices <= 3, (stack.out_offsets, cfg)
    assert stack.b.dtype == out.dtype and stack.b.stride(2) == 1 and y.stride(3) == 1, (stack.b.dtype, out.dtype)
    assert y.shape[0] & (y.shape[0] - 1) == 0, y.shape  # tl.static_range over planes
    ends = [stack.out_offsets[min(s, stack.num_slices)] for s in (1, 2)]  # slices 0, 1 end here
    block_r = max(16, triton.next_power_of_2(batch.rank_bound(stack.max_rank)))
    rows = batch.slots if batch.rows is None else batch.rows  # any tensor: GATHER=False never reads it
    return (y, stack.b, stack.ranks, batch.starts, batch.lens, batch.slots, rows, batch.capacity, *ends,
            stack.max_rank, y.stride(0), y.stride(1), y.stride(2), stack.b.stride(0), stack.b.stride(1),
            stack.ranks.stride(0), True, batch.rows is not None, group_block(batch.capacity), block_r, y.shape[0])


# Group counts change from step to step: not specialized on (== 1, multiples of 16), nor the batch
# metadata's alignment, so that each step shape does not compile another variant.
@triton.jit(do_not_specialize=["num_groups", "stride_y_split"],
            do_not_specialize_on_alignment=["starts_ptr", "lens_ptr", "slots_ptr", "rows_ptr"])
def _skinny_linear_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, num_rows, out_features, in_features,
                          stride_xm, stride_wn, stride_om,
                          y_ptr, b_ptr, ranks_ptr, starts_ptr, lens_ptr, slots_ptr, rows_ptr, num_groups, end0,
                          end1, max_rank, stride_y_split, stride_ym, stride_y_slice, stride_b_slot, stride_b_rank,
                          stride_ranks_slot,
                          HAS_LORA: tl.constexpr, GATHER: tl.constexpr, GROUP_BLOCK: tl.constexpr,
                          BLOCK_R: tl.constexpr, SPLIT: tl.constexpr,
                          HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr):
    if not HAS_LORA:
        pdl.wait_for_inputs(PDL)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output columns
    offs_m = tl.arange(0, BLOCK_M)
    n_mask = offs_n < out_features
    m_mask = offs_m < num_rows
    w_rows = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn      # [1, BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, in_features, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        k_mask = offs_k < in_features
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)           # [BLOCK_M, BLOCK_K]
        w = tl.load(w_rows + offs_k[:, None], mask=n_mask[None, :] & k_mask[:, None], other=0.0)  # [BLOCK_K, BLOCK_N] = Wᵀ tile
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
    if HAS_LORA:
        pdl.wait_for_inputs(PDL)  # for y: the shrink launched just before writes it
        acc = _add_lora(acc, y_ptr, b_ptr, ranks_ptr, starts_ptr, lens_ptr, slots_ptr, rows_ptr, num_groups, end0,
                        end1, max_rank, stride_y_split, stride_ym, stride_y_slice, stride_b_slot, stride_b_rank,
                        stride_ranks_slot, offs_m, m_mask, offs_n, n_mask, GATHER, GROUP_BLOCK, BLOCK_N, BLOCK_R,
                        SPLIT, DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _add_lora(acc, y_ptr, b_ptr, ranks_ptr, starts_ptr, lens_ptr, slots_ptr, rows_ptr, num_groups, end0, end1,
              max_rank, stride_y_split, stride_ym, stride_y_slice, stride_b_slot, stride_b_rank, stride_ranks_slot,
              offs_m, m_mask, offs_n, n_mask, GATHER: tl.constexpr, GROUP_BLOCK: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc + for each group g: (y rows of g's tokens) @ B[slot_g, :rank, this tile's columns], in fp32.

    The tile lies in one slice (fuses_lora). Before the loop, one read of the batch metadata gives each
    row its position in the groups' order (the row order's inverse when GATHER), hence its group's rank:
    y's planes are summed and its columns past that rank zeroed (the shrink leaves them unspecified),
    once. Each group is then one K step of rank depth, all rows times its B tile, of which only its rows
    are added: the loop-invariant y tile keeps its tensor-core layout, and the step's only load is B,
    whose address comes from registers, so the loop pipelines its B tiles. Groups past the last with
    tokens (a graph's padding) are not visited; empty slots and untargeted slices have rank 0, and
    their B loads read nothing."""
    first_col = tl.program_id(0) * BLOCK_N
    slice_idx = (first_col >= end0).to(tl.int32) + (first_col >= end1).to(tl.int32)
    offs_g = tl.arange(0, GROUP_BLOCK)
    g_mask = offs_g < num_groups
    slots = tl.load(slots_ptr + offs_g, mask=g_mask, other=-1)
    starts = tl.load(starts_ptr + offs_g, mask=g_mask, other=0)
    ends = starts + tl.load(lens_ptr + offs_g, mask=g_mask, other=0)
    ranks = tl.load(ranks_ptr + slots * stride_ranks_slot + slice_idx, mask=slots >= 0, other=0)
    if GATHER:  # row i's position: where the row order lists it (-1: a base-only token)
        listed = tl.load(rows_ptr + offs_m, mask=offs_m < tl.max(ends, axis=0), other=-1)
        pos = tl.max(tl.where(listed[None, :] == offs_m[:, None], offs_m[None, :], -1), axis=1)
    else:
        pos = offs_m
    in_group = (pos[:, None] >= starts[None, :]) & (pos[:, None] < ends[None, :])  # [BLOCK_M, GROUP_BLOCK]
    row_rank = tl.sum(tl.where(in_group, ranks[None, :], 0), axis=1)
    offs_r = tl.arange(0, BLOCK_R)
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + slice_idx * stride_y_slice + offs_r[None, :]
    y_mask = m_mask[:, None] & (offs_r < max_rank)[None, :]
    y = tl.load(y_ptrs, mask=y_mask, other=0.0)
    for s in tl.static_range(1, SPLIT):
        y += tl.load(y_ptrs + s * stride_y_split, mask=y_mask, other=0.0)
    y = tl.where(offs_r[None, :] < row_rank[:, None], y, 0.0).to(b_ptr.dtype.element_ty)
    # One word per group (each field < 2^16: rows <= MAX_ROWS, ranks and slots far below): one
    # reduction a step picks the group's fields out of registers.
    packed = (((slots + 1).to(tl.int64) << 48) | (ranks.to(tl.int64) << 32) | (starts.to(tl.int64) << 16)
              | ends.to(tl.int64))
    num_used = tl.max(tl.where(ends > starts, offs_g + 1, 0), axis=0)
    for g in tl.range(0, num_used, num_stages=LORA_STAGES):
        word = tl.sum(tl.where(offs_g == g, packed, 0), axis=0)
        slot = (word >> 48).to(tl.int32) - 1
        rank = ((word >> 32) & 0xFFFF).to(tl.int32)
        start = ((word >> 16) & 0xFFFF).to(tl.int32)
        end = (word & 0xFFFF).to(tl.int32)
        b = tl.load(b_ptr + slot.to(tl.int64) * stride_b_slot + offs_r[:, None] * stride_b_rank + offs_n[None, :],
                    mask=(offs_r < rank)[:, None] & n_mask[None, :], other=0.0)  # [BLOCK_R, BLOCK_N]
        part = tl.dot(y, b, input_precision=DOT_PRECISION)
        acc += tl.where(((pos >= start) & (pos < end))[:, None], part, 0.0)
    return acc
