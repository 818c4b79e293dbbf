"""All-layer merge, the contract: fold one adapter slot's scaling · B·A into every base weight it
targets, saving what it overwrites; and the exact reverse. Its torch reference is here too.

A task is one output slice s of one projection's weight: W[rows of s] += scaling[slot, s] * B_s @ A_s
of the slot's adapter (the arena holds B_sᵀ). On CUDA one Triton launch walks every tile of every
task (kernels/triton/merge.py: a table of addresses per task), writes each weight tile's old value
to its backup before adding the delta, and a restore copies backups back, so the base weights come
back bit-identical however often they are merged. The torch reference does the same task by task (CPU).
kernels/__init__.py picks the backend (`merge_weights`, `restore_weights`, `warm_up_merge`).
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


def merge_weights_reference(targets: Sequence[MergeTarget], slot: int) -> None:
    for target in targets:
        target.backup.copy_(target.weight)
        stack = target.stack
        for s, rank in enumerate(stack.host_ranks[slot]):
            if rank == 0:
                continue
            rows = slice(stack.out_offsets[s], stack.out_offsets[s + 1])
            b, a = stack.b_weight(slot, s).float(), stack.a_weight(slot, s).float()  # Bᵀ [r, rows], A [r, in]
            delta = (b.t() @ a) * stack.host_scalings[slot][s]
            target.weight[rows] = (target.weight[rows].float() + delta).to(target.weight.dtype)


def restore_weights_reference(targets: Sequence[MergeTarget]) -> None:
    for target in targets:
        target.weight.copy_(target.backup)
