"""The kernel contract: how a packed batch maps its tokens to adapter slots.

Tokens of all sequences in a step are packed into one [num_tokens, hidden] matrix. A segment is
a contiguous token range served by one adapter slot (or by none). Example, a batch of a 5-token
prefill with slot 2, a decode token with no adapter and a decode token with slot 0, built with
capacity 4 (as for a CUDA graph of 4 segments):

    seg_starts = (0, 5, 6)   seg_lens = (5, 1, 1)   seg_slots = (2, NO_SLOT, 0)   max_seg_len = 5
    starts = [0, 5, 6, 7]    lens = [5, 1, 1, 0]    slots = [2, -1, 0, -1]          (device, int32)

The host tuples answer "does any token use LoRA" without a device sync (the torch reference walks
them); the Triton kernels read only the device tensors, so a captured graph replays with new
contents copied into them. `max_seg_len` and `num_tokens` are the only host ints the kernels'
grids depend on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch

NO_SLOT = -1  # the segment's tokens use the base model only


@dataclass(frozen=True, eq=False)  # holds tensors: identity, not value, equality
class LoRABatch:
    num_tokens: int                 # rows of the packed batch
    seg_starts: tuple[int, ...]     # [num_segments] first token of each segment
    seg_lens: tuple[int, ...]       # [num_segments] tokens in each segment (may be 0)
    seg_slots: tuple[int, ...]      # [num_segments] adapter slot of each segment, or NO_SLOT
    max_seg_len: int                # bound on every segment's length, now and at graph replay
    starts: torch.Tensor            # int32 [capacity] device copy of seg_starts, padded
    lens: torch.Tensor              # int32 [capacity] device copy of seg_lens, padded with 0
    slots: torch.Tensor             # int32 [capacity] device copy of seg_slots, padded with NO_SLOT

    def __post_init__(self) -> None:
        num_segments = len(self.seg_lens)
        assert len(self.seg_starts) == num_segments == len(self.seg_slots)
        assert all(s >= 0 and n >= 0 and s + n <= self.num_tokens
                   for s, n in zip(self.seg_starts, self.seg_lens)), (self.seg_starts, self.seg_lens)
        assert all(slot >= NO_SLOT for slot in self.seg_slots), self.seg_slots
        assert self.max_seg_len >= max(self.seg_lens, default=0), (self.max_seg_len, self.seg_lens)
        for t in (self.starts, self.lens, self.slots):
            assert t.dtype == torch.int32 and t.shape == (self.capacity,), (t.dtype, t.shape)
        assert self.capacity >= num_segments, (self.capacity, num_segments)

    @property
    def capacity(self) -> int:
        """Segments the device tensors hold, padding included (the kernels' grid size)."""
        return self.starts.shape[0]

    @property
    def has_lora(self) -> bool:
        """Host-only: does any token of this batch use an adapter slot."""
        return any(slot != NO_SLOT and n > 0 for slot, n in zip(self.seg_slots, self.seg_lens))

    @staticmethod
    def build(seg_lens: Sequence[int], seg_slots: Sequence[int], device: torch.device | str,
              capacity: int | None = None, max_seg_len: int | None = None) -> LoRABatch:
        """Segments laid end to end from token 0; device tensors padded to `capacity` segments.

        `max_seg_len` defaults to the longest segment; pass a larger bound when this batch is
        captured in a graph that later replays longer segments.
        """
        seg_lens, seg_slots = tuple(seg_lens), tuple(seg_slots)
        num_segments = len(seg_lens)
        capacity = num_segments if capacity is None else capacity
        assert capacity >= num_segments, (capacity, num_segments)
        seg_starts = (0, *accumulate(seg_lens))[:num_segments]
        num_tokens = sum(seg_lens)
        pad = capacity - num_segments
        # Padded segments start at the batch end with no tokens and no slot: kernels skip them.
        host = torch.tensor([(*seg_starts, *[num_tokens] * pad),
                             (*seg_lens, *[0] * pad),
                             (*seg_slots, *[NO_SLOT] * pad)], dtype=torch.int32)  # [3, capacity]
        device = torch.device(device)
        if device.type == "cuda":
            host = host.pin_memory()
        meta = host.to(device, non_blocking=True)  # one copy for all three
        return LoRABatch(num_tokens, seg_starts, seg_lens, seg_slots,
                         max(seg_lens, default=0) if max_seg_len is None else max_seg_len,
                         meta[0], meta[1], meta[2])

    def copy_into(self, other: LoRABatch) -> None:
        """Copy this batch's device tensors into `other`'s (a captured graph's static inputs).

        Afterwards other's device tensors describe this batch, while its host fields still
        describe the batch it was built with: only the kernels' grid bounds must cover this one.
        """
        assert other.capacity >= self.capacity, (other.capacity, self.capacity)
        assert other.max_seg_len >= self.max_seg_len, (other.max_seg_len, self.max_seg_len)
        assert other.num_tokens >= self.num_tokens, (other.num_tokens, self.num_tokens)
        n = self.capacity
        other.starts[:n].copy_(self.starts, non_blocking=True)
        other.lens[:n].copy_(self.lens, non_blocking=True)
        other.slots[:n].copy_(self.slots, non_blocking=True)
        other.lens[n:].fill_(0)
        other.slots[n:].fill_(NO_SLOT)
