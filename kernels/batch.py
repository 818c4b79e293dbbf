"""The kernel contract: how a packed batch maps its tokens to adapter slots.

Tokens of all sequences in a step are packed into one [num_tokens, hidden] matrix. A segment is
a contiguous token range served by one adapter slot (or by none); that is how callers describe a
batch. The kernels see *groups*: all tokens of one slot, so each adapter's weights are read once
per tile of its tokens however its requests interleave. Example, a 5-token prefill with slot 2,
a decode token with no adapter, a decode token with slot 0, built with capacity 4 (as for a CUDA
graph of 4 segments):

    seg_starts = (0, 5, 6)   seg_lens = (5, 1, 1)   seg_slots = (2, NO_SLOT, 0)
    groups:  starts = [0, 6, 7, 7]   lens = [5, 1, 0, 0]   slots = [2, 0, -1, -1]   (device, int32)
    rows = None: each slot's tokens are one contiguous range       max_group_len = 5

When one slot's tokens are not contiguous (segments (2, 3, 2) with slots (0, 1, 0)), the groups
index a device row order instead: rows = [0, 1, 5, 6, 2, 3, 4], starts = [0, 4], lens = [4, 3]
(tokens of NO_SLOT segments are left out of it).

A mixture batch (deLoRA: one adapter folded into the base weights, `mix_slot` a slot holding it with
negated scalings) runs that slot beside every other group's own adapter, as one adapter of both
ranks: y's columns [0, r) hold a group's own adapter's, [r, r + r_mix) the mixture slot's, and expand
adds both products. Tokens of the base model run the mixture slot alone (their segments name it),
the merged adapter's tokens nothing (NO_SLOT). So mixture costs one more rank block of the same
launches, not another pass.

The host tuples answer "does any token use LoRA" without a device sync (the torch reference walks
them); the Triton kernels read only the device tensors, so a captured graph replays with new
contents copied into them. `max_group_len` and `num_tokens` are the only host ints the kernels'
grids depend on. Groups of NO_SLOT (or padding) are skipped by the kernels.
"""

from __future__ import annotations

import math
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
    max_group_len: int              # bound on any one group's tokens, now and at graph replay
    starts: torch.Tensor            # int32 [capacity] each group's first position (in `rows` order if any)
    lens: torch.Tensor              # int32 [capacity] tokens in each group, padded with 0
    slots: torch.Tensor             # int32 [capacity] slot of each group, padded with NO_SLOT
    rows: torch.Tensor | None = None  # int32 [tokens in groups] token of each position; None: identity
    max_rank: int | None = None     # bound on the rank of every adapter the groups' slots hold;
    #                                 None: any rank a stack holds (its max_rank)
    mean_rank: float | None = None  # the groups' ranks averaged over their tokens, when the caller
    #                                 knows them: tiles are tuned apart for mixed-rank batches
    mix_slot: int = NO_SLOT         # mixture batches: the slot every group of another slot also runs

    def __post_init__(self) -> None:
        num_segments = len(self.seg_lens)
        assert len(self.seg_starts) == num_segments == len(self.seg_slots)
        assert all(s >= 0 and n >= 0 and s + n <= self.num_tokens
                   for s, n in zip(self.seg_starts, self.seg_lens)), (self.seg_starts, self.seg_lens)
        assert all(slot >= NO_SLOT for slot in self.seg_slots), self.seg_slots
        assert self.max_group_len >= max(_group_lens(self.seg_lens, self.seg_slots), default=0), (
            self.max_group_len, self.seg_lens, self.seg_slots)
        for t in (self.starts, self.lens, self.slots):
            assert t.dtype == torch.int32 and t.shape == (self.capacity,), (t.dtype, t.shape)
        assert self.rows is None or (self.rows.dtype == torch.int32 and self.rows.dim() == 1
                                     and self.rows.shape[0] <= self.num_tokens)
        assert self.max_rank is None or self.max_rank >= 0, self.max_rank
        assert self.mean_rank is None or 0 <= self.mean_rank <= (self.max_rank or math.inf), (
            self.mean_rank, self.max_rank)

    @property
    def capacity(self) -> int:
        """Groups the device tensors hold, padding included (the kernels' grid bound)."""
        return self.starts.shape[0]

    def rank_bound(self, stack_max_rank: int) -> int:
        """The ranks a kernel must cover for a stack serving ranks up to `stack_max_rank`: the batch's
        bound when known, so that a batch of rank-8 adapters in a rank-128 stack tiles 8 ranks, not 128.
        A mixture group runs two adapters' ranks."""
        ranks = self.y_ranks(stack_max_rank)
        return ranks if self.max_rank is None else min(ranks, self.max_rank)

    def y_ranks(self, stack_max_rank: int) -> int:
        """Columns of the y that shrink hands expand, per slice: a group's own ranks, and a mixture
        batch's mixture slot's after them."""
        return stack_max_rank * (2 if self.is_mixture else 1)

    @property
    def is_mixture(self) -> bool:
        return self.mix_slot != NO_SLOT

    @property
    def has_lora(self) -> bool:
        """Host-only: does any token of this batch use an adapter slot."""
        return any(slot != NO_SLOT and n > 0 for slot, n in zip(self.seg_slots, self.seg_lens))

    @staticmethod
    def build(seg_lens: Sequence[int], seg_slots: Sequence[int], device: torch.device | str,
              capacity: int | None = None, max_group_len: int | None = None,
              max_rank: int | None = None, mean_rank: float | None = None, mix_slot: int = NO_SLOT) -> LoRABatch:
        """Segments laid end to end from token 0, grouped by slot; device tensors padded to
        `capacity` groups (default: as many as there are).

        `max_group_len` defaults to the largest group; pass a larger bound when this batch is
        captured in a graph that later replays larger groups. `max_rank`, when the caller knows
        it, bounds the rank of every adapter in the batch's slots (see `rank_bound`); `mean_rank`,
        likewise, is their token-weighted mean (see kernels/tiling.py, `is_mixed`). `mix_slot`: a
        mixture batch's mixture slot (see the module's docstring; `max_rank` then bounds both ranks).
        """
        seg_lens, seg_slots = tuple(seg_lens), tuple(seg_slots)
        seg_starts = (0, *accumulate(seg_lens))[:len(seg_lens)]
        num_tokens = sum(seg_lens)
        ranges: dict[int, list[range]] = {}  # slot -> its segments' token ranges, in batch order
        for start, n, slot in zip(seg_starts, seg_lens, seg_slots):
            if slot != NO_SLOT and n > 0:
                ranges.setdefault(slot, []).append(range(start, start + n))
        contiguous = all(r.stop == nxt.start for rs in ranges.values() for r, nxt in zip(rs, rs[1:]))
        lens = [sum(len(r) for r in rs) for rs in ranges.values()]
        if contiguous:
            starts = [rs[0].start for rs in ranges.values()]
            rows = None
        else:
            starts = [0, *accumulate(lens)][:len(lens)]
            rows = [t for rs in ranges.values() for r in rs for t in r]
        capacity = len(lens) if capacity is None else capacity
        assert capacity >= len(lens), (capacity, len(lens))
        pad = capacity - len(lens)
        # Padding groups start at the batch end with no tokens and no slot: kernels skip them.
        host = torch.tensor([*starts, *[num_tokens] * pad, *lens, *[0] * pad, *ranges, *[NO_SLOT] * pad,
                             *(rows or [])], dtype=torch.int32)
        device = torch.device(device)
        if device.type == "cuda":
            host = host.pin_memory()
        meta = host.to(device, non_blocking=True)  # one copy for all of it
        return LoRABatch(num_tokens, seg_starts, seg_lens, seg_slots,
                         max(lens, default=0) if max_group_len is None else max_group_len,
                         meta[:capacity], meta[capacity:2 * capacity], meta[2 * capacity:3 * capacity],
                         None if rows is None else meta[3 * capacity:], max_rank, mean_rank, mix_slot)

    def copy_into(self, other: LoRABatch) -> None:
        """Copy this batch's device tensors into `other`'s (a captured graph's static inputs).

        Afterwards other's device tensors describe this batch, while its host fields still
        describe the batch it was built with: only the kernels' grid bounds must cover this one.
        """
        assert other.capacity >= self.capacity, (other.capacity, self.capacity)
        assert other.max_group_len >= self.max_group_len, (other.max_group_len, self.max_group_len)
        assert other.max_rank is None or (self.max_rank is not None and other.max_rank >= self.max_rank), (
            other.max_rank, self.max_rank)
        assert other.num_tokens >= self.num_tokens, (other.num_tokens, self.num_tokens)
        assert self.rows is None and other.rows is None, "graphs replay batches grouped in token order"
        assert not (self.is_mixture or other.is_mixture), "mixture steps run eager"
        n = self.capacity
        other.starts[:n].copy_(self.starts, non_blocking=True)
        other.lens[:n].copy_(self.lens, non_blocking=True)
        other.slots[:n].copy_(self.slots, non_blocking=True)
        other.lens[n:].fill_(0)
        other.slots[n:].fill_(NO_SLOT)


def _group_lens(seg_lens: Sequence[int], seg_slots: Sequence[int]) -> list[int]:
    """Tokens per slot (NO_SLOT excluded)."""
    totals: dict[int, int] = {}
    for n, slot in zip(seg_lens, seg_slots):
        if slot != NO_SLOT:
            totals[slot] = totals.get(slot, 0) + n
    return list(totals.values())
