"""All-layer merge: fold one adapter slot's scaling · B·A into every base weight it targets, in one
launch on CUDA, saving what it overwrites; and the exact reverse.

A task is one output slice of one projection's weight: W[rows] += scaling * b[slot, :r, rows]ᵀ @
A[slot, slice, :r]. The Triton kernel walks every tile of every task in a single grid (a table of
tensor addresses per task), writes each weight tile's old value to its backup before adding the
delta, and `restore_weights` copies backups back, so the base weights come back bit-identical
however often they are merged. The torch reference does the same task by task (CPU).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels.lora_stack import LoRAStack


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: launches are cached per set of targets
class MergeTarget:
    """A projection whose weight an adapter slot is folded into, and where its old value is kept.
    Callers that merge the same projections again pass the same objects (the CUDA launch's
    description is built once per set)."""
    weight: torch.Tensor   # [out_features, in_features], rows contiguous
    backup: torch.Tensor   # same shape and dtype
    stack: LoRAStack


def merge_weights(targets: Sequence[MergeTarget], slot: int) -> None:
    """backup <- W, then W[slice rows] += scaling * B @ A for each slice the slot's adapter targets."""
    if targets and targets[0].weight.is_cuda:
        from kernels.triton_merge import merge_weights_triton  # triton only where CUDA is
        merge_weights_triton(targets, slot)
    else:
        merge_weights_reference(targets, slot)


def warm_up_merge(targets: Sequence[MergeTarget]) -> None:
    """Compile (CUDA) the merge and restore kernels `targets` select, launching nothing, so that the
    first merge of a worker does not wait on a compile. Backups are not read: a weight may stand in
    for its own."""
    if targets and targets[0].weight.is_cuda:
        from kernels.triton_merge import merge_weights_triton, restore_weights_triton
        merge_weights_triton(targets, 0, compile_only=True)
        restore_weights_triton(targets, compile_only=True)


def restore_weights(targets: Sequence[MergeTarget]) -> None:
    """W <- backup for every target (bit-exact)."""
    if targets and targets[0].weight.is_cuda:
        from kernels.triton_merge import restore_weights_triton
        restore_weights_triton(targets)
    else:
        for target in targets:
            target.weight.copy_(target.backup)


def merge_weights_reference(targets: Sequence[MergeTarget], slot: int) -> None:
    for target in targets:
        target.backup.copy_(target.weight)
        stack = target.stack
        for s, rank in enumerate(stack.host_ranks[slot]):
            if rank == 0:
                continue
            rows = slice(stack.out_offsets[s], stack.out_offsets[s + 1])
            delta = (stack.b[slot, :rank, rows].float().t() @ stack.a[slot, s, :rank].float()) * stack.scalings[slot].float()
            target.weight[rows] = (target.weight[rows].float() + delta).to(target.weight.dtype)
