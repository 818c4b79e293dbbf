"""Builds the kernels' LoRABatchInfo from the step's packed sequences (one segment per sequence)."""

from __future__ import annotations

from collections.abc import Sequence

from kernels import NO_SLOT, LoRABatchInfo


def build_lora_batch_info(num_new_tokens: Sequence[int], slots: Sequence[int], ranks: Sequence[int]) -> LoRABatchInfo:
    """Per packed sequence i: its new-token count, adapter slot (or NO_SLOT) and that adapter's rank."""
    starts, position = [], 0
    for n in num_new_tokens:
        starts.append(position)
        position += n
    max_rank = max((r for s, r in zip(slots, ranks) if s != NO_SLOT), default=0)
    return LoRABatchInfo(position, tuple(starts), tuple(num_new_tokens), tuple(slots), max_rank)
