"""Torch reference LoRA ops: per-segment, per-slice matmuls accumulated in float32.

Used on CPU, and as the ground truth the Triton kernels are checked against. It walks the batch's
host tuples and the stack's host mirrors (ranks, scalings, arena offsets), so it never syncs with a
device but cannot be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from kernels.batch import NO_SLOT, LoRABatch
from kernels.lora_stack import LoRAStack


def lora_shrink(x: torch.Tensor, stack: LoRAStack, batch: LoRABatch) -> torch.Tensor:
    """y[t, s, :r_s] = scaling[slot, s] * x[t] @ A_sᵀ of the slot's adapter, for tokens of segments using a slot;
    in a mixture batch, columns [r_s, r_s + r_mix) likewise of the mixture slot for segments of other slots.

    x:      [num_tokens, in_features]
    returns y: float32 [1, num_tokens, num_slices, batch.y_ranks(max_rank)] (one plane: no split of K);
            entries of base-only tokens, untargeted slices and rank columns past the ranks are zero.
    """
    stack.check_shrink_args(x, batch)
    planes = torch.zeros(1, batch.num_tokens, stack.num_slices, batch.y_ranks(stack.max_rank), dtype=torch.float32,
                         device=x.device)
    if not batch.has_lora:
        return planes
    y = planes[0]
    for start, length, slot in zip(batch.seg_starts, batch.seg_lens, batch.seg_slots):
        if slot == NO_SLOT or length == 0:
            continue
        rows = x[start:start + length].float()  # [length, in_features]
        for s, (first, count, part) in enumerate(_rank_parts(stack, batch, slot)):
            for begin, rank, adapter in ((0, first, slot), (first, count, part)):
                if rank:
                    a = stack.a_weight(adapter, s).float()  # [rank, in_features]
                    y[start:start + length, s, begin:begin + rank] = (rows @ a.t()) * stack.host_scalings[adapter][s]
    return planes


def _rank_parts(stack: LoRAStack, batch: LoRABatch, slot: int) -> list[tuple[int, int, int]]:
    """Per slice: (the slot's rank, the mixture slot's rank it also runs (0: none), the mixture slot)."""
    mixed = batch.is_mixture and slot != batch.mix_slot
    return [(rank, stack.host_ranks[batch.mix_slot][s] if mixed else 0, batch.mix_slot)
            for s, rank in enumerate(stack.host_ranks[slot])]


def lora_expand(out: torch.Tensor, y: torch.Tensor, stack: LoRAStack, batch: LoRABatch) -> None:
    """out[t, slice s columns] += y.sum(0)[t, s, :r_s] @ B_sᵀ [r_s, out_size_s] of the slot's adapter, in place.

    out: [num_tokens, out_features] the base projection's output (any float dtype)
    y:   [splits, num_tokens, num_slices, y_ranks] from lora_shrink: partial sums over K (float32, or one
         plane in the stack's dtype); a mixture batch's groups add their mixture columns' product too
    Rows of base-only tokens and columns of untargeted slices are left untouched.
    """
    stack.check_expand_args(out, y, batch)
    if not batch.has_lora:
        return
    y = y.float().sum(0)
    for start, length, slot in zip(batch.seg_starts, batch.seg_lens, batch.seg_slots):
        if slot == NO_SLOT or length == 0:
            continue
        for s, (first, count, part) in enumerate(_rank_parts(stack, batch, slot)):
            if first + count == 0:
                continue
            cols = slice(stack.out_offsets[s], stack.out_offsets[s + 1])
            delta = torch.zeros(length, cols.stop - cols.start, dtype=torch.float32, device=out.device)
            for begin, rank, adapter in ((0, first, slot), (first, count, part)):
                if rank:
                    b_t = stack.b_weight(adapter, s).float()  # [rank, out_size]
                    delta += y[start:start + length, s, begin:begin + rank] @ b_t
            target = out[start:start + length, cols]
            target.copy_(target.float() + delta)
