"""The kernel contract: how a packed batch maps its tokens to adapter slots.

Tokens of all sequences in a step are packed into one [num_tokens, hidden] matrix. A segment is
a contiguous token range served by one adapter slot (or by none). Example, a batch of a 5-token
prefill with slot 2, a decode token with no adapter and a decode token with slot 0:

    seg_starts = (0, 5, 6)   seg_lens = (5, 1, 1)   seg_slots = (2, NO_SLOT, 0)

Every slot holds its own rank: low-rank adapters are never padded to the largest one. The fields
are host-side tuples so that checking "does any token use LoRA" never syncs with a device.
"""

from __future__ import annotations

from dataclasses import dataclass

NO_SLOT = -1  # the segment's tokens use the base model only


@dataclass(frozen=True)
class LoRABatchInfo:
    num_tokens: int                 # rows of the packed batch
    seg_starts: tuple[int, ...]     # [num_segments] first token of each segment
    seg_lens: tuple[int, ...]       # [num_segments] tokens in each segment (may be 0)
    seg_slots: tuple[int, ...]      # [num_segments] adapter slot of each segment, or NO_SLOT
    max_rank: int                   # largest rank among the slots used; 0 when no token uses LoRA

    def __post_init__(self) -> None:
        assert len(self.seg_starts) == len(self.seg_lens) == len(self.seg_slots)
        assert all(s >= 0 and n >= 0 and s + n <= self.num_tokens
                   for s, n in zip(self.seg_starts, self.seg_lens))
        assert all(slot >= NO_SLOT for slot in self.seg_slots)
        assert self.max_rank >= 0

    @property
    def has_lora(self) -> bool:
        return self.max_rank > 0 and any(
            slot != NO_SLOT and n > 0 for slot, n in zip(self.seg_slots, self.seg_lens))

    @staticmethod
    def no_lora(num_tokens: int) -> LoRABatchInfo:
        return LoRABatchInfo(num_tokens, (0,), (num_tokens,), (NO_SLOT,), 0)
