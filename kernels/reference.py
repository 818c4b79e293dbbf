"""Torch reference LoRA ops: per-segment matmuls accumulated in float32.

Used on CPU, and as the ground truth the Triton kernels are checked against. Weights are given
per slot: `lora_a[slot]` / `lora_b[slot]` is None when the slot is empty or the adapter in it does
not target this projection; those segments are skipped.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.batch import NO_SLOT, LoRABatchInfo


def lora_shrink(x: torch.Tensor, lora_a: Sequence[torch.Tensor | None], scalings: Sequence[float],
                batch: LoRABatchInfo) -> torch.Tensor:
    """y = (x @ A_slotᵀ) * scaling_slot for every token of every segment.

    x:        [num_tokens, in_features]
    lora_a:   [num_slots] of [rank_slot, in_features] or None
    scalings: [num_slots] alpha / rank of each slot
    returns   y: [num_tokens, batch.max_rank] float32; a segment with rank r fills y[:, :r],
              the remaining columns (and rows of base-only tokens) are zero.
    """
    assert x.dim() == 2 and x.shape[0] == batch.num_tokens, (x.shape, batch.num_tokens)
    assert len(lora_a) == len(scalings)
    y = torch.zeros(batch.num_tokens, batch.max_rank, dtype=torch.float32, device=x.device)
    if not batch.has_lora:
        return y
    for start, length, slot in zip(batch.seg_starts, batch.seg_lens, batch.seg_slots):
        if slot == NO_SLOT or length == 0 or lora_a[slot] is None:
            continue
        a = lora_a[slot]
        assert a.dim() == 2 and a.shape[1] == x.shape[1] and a.shape[0] <= batch.max_rank, (a.shape, x.shape)
        rows = slice(start, start + length)
        y[rows, : a.shape[0]] = (x[rows].float() @ a.float().t()) * scalings[slot]
    return y


def lora_expand(out: torch.Tensor, y: torch.Tensor, lora_b: Sequence[torch.Tensor | None],
                batch: LoRABatchInfo) -> None:
    """out += y @ B_slotᵀ for every token of every segment, in place.

    out:    [num_tokens, out_features] the base projection's output (any float dtype)
    y:      [num_tokens, batch.max_rank] float32, from lora_shrink
    lora_b: [num_slots] of [out_features, rank_slot] or None
    """
    assert out.dim() == 2 and out.shape[0] == batch.num_tokens, (out.shape, batch.num_tokens)
    assert y.shape == (batch.num_tokens, batch.max_rank), (y.shape, batch.max_rank)
    if not batch.has_lora:
        return
    for start, length, slot in zip(batch.seg_starts, batch.seg_lens, batch.seg_slots):
        if slot == NO_SLOT or length == 0 or lora_b[slot] is None:
            continue
        b = lora_b[slot]
        assert b.dim() == 2 and b.shape[0] == out.shape[1], (b.shape, out.shape)
        rows = slice(start, start + length)
        delta = y[rows, : b.shape[1]] @ b.float().t()  # [length, out_features] float32
        out[rows] = (out[rows].float() + delta).to(out.dtype)
