"""Compile every LoRA kernel variant a worker can meet before it serves its first request.

A Triton kernel compiles on its first call with a new set of compile-time values: the tile
configuration the table gives a shape bucket, the rank tile, whether the batch gathers rows and
whether each group fits one tile. Each compile stalls the whole step, so a worker that met its
variants while serving stalled its first requests of every new batch shape (a LLaVA-7B met dozens
in its first bursts, docs/benchmarks/vision.md).

The variants follow from host ints alone (kernels/tiling.py's bucket key and the constexprs of
lora_shrink and lora_expand), so they can be listed from the worker's limits: for every token
point up to the step budget, every group point up to it (its smallest and largest group, which
decide ONE_TILE for row tiles in between), every rank tile up to the slots' rank, contiguous and
gathered rows, ranks mixed or not; with merged mode on, the mixture batches' variants too (two
adapters' ranks a group: kernels/batch.py). Nothing is launched: inside compile_ahead's `compiling_ahead`
the compiles run in parallel.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import triton

from kernels import tiling
from kernels.batch import NO_SLOT, LoRABatch
from kernels.lora_stack import LoRAStack
from kernels.triton.lora_common import group_block
from kernels.triton.lora_expand import lora_expand
from kernels.triton.lora_shrink import lora_shrink


@dataclass(frozen=True)
class BatchShape:
    """What of a batch picks a LoRA kernel variant."""
    tokens: int
    max_group_len: int
    max_rank: int
    gather: bool
    mixed: bool  # its mean rank is known to be low (tiling.is_mixed): the table may tile it apart
    mixture: bool = False  # a mixture batch: every group also runs the mixture slot's ranks

    def segments(self) -> tuple[list[int], list[int]]:
        """(segment lengths, slots) of a batch of this shape: one group of max_group_len tokens,
        split around a base-only segment when it must gather; base-only tokens fill the rest."""
        group, rest = self.max_group_len, self.tokens - self.max_group_len
        if self.gather:  # slot 0's tokens on both sides of a base-only token
            return [group - group // 2, 1, group // 2, rest - 1], [0, NO_SLOT, 0, NO_SLOT]
        return [group, rest], [0, NO_SLOT]


def batch_shapes(max_tokens: int, max_rank: int, mixture: bool = False) -> Iterator[BatchShape]:
    """Every variant-deciding batch shape of steps of up to `max_tokens` tokens with adapters of
    rank up to `max_rank`; with `mixture`, those of mixture steps too (rank bound: two adapters')."""
    points = tiling.TOKEN_POINTS
    rank_tiles = [r for r in (16, 32, 64, 128, 256) if r <= max(16, triton.next_power_of_2(max_rank))]
    for token_point in (t for t in points if t <= tiling.round_up(max_tokens, points)):
        tokens = min(token_point, max_tokens)
        previous = 0
        for group_point in (g for g in points if g <= token_point):
            for group_len in sorted({min(previous + 1, tokens), min(group_point, tokens)}):
                for rank in rank_tiles:
                    for gather in (False, True):
                        # Gathering needs a base-only token between two of the group's: a group
                        # of all but one token stands for a batch-wide one (same group point).
                        length = min(group_len, tokens - 1) if gather else group_len
                        if not gather or length >= 2:
                            yield BatchShape(tokens, length, rank, gather, mixed=False)
                            yield BatchShape(tokens, length, rank, gather, mixed=True)
                            if mixture and rank == rank_tiles[-1]:
                                yield BatchShape(tokens, length, 2 * max_rank, gather, mixed=False, mixture=True)
            previous = group_point


def warm_up_lora(stacks: Iterable[LoRAStack], max_tokens: int, capacity: int, mixture: bool = False) -> int:
    """Compile shrink and expand for every batch shape of every stack (one per distinct projection
    shape), mixture batches' too with `mixture`. `capacity`: the most groups a step's batch may hold
    (the adapter slots). Returns the variants requested."""
    by_shape = {(s.in_features, s.out_offsets, s.max_rank, s.dtype): s for s in stacks}
    shapes = list(batch_shapes(max_tokens, max(s.max_rank for s in by_shape.values()) if by_shape else 16, mixture))
    # Kernels scan up to max(64, capacity rounded up to a power of 2) groups: one capacity per scan size.
    capacities = sorted({min(group_block(c), capacity) for c in range(1, capacity + 1)})
    requested = 0
    for stack in by_shape.values():
        x = torch.empty(max_tokens, stack.in_features, dtype=stack.dtype, device=stack.device)
        out = torch.empty(max_tokens, stack.out_features, dtype=stack.dtype, device=stack.device)
        for shape in shapes:
            if shape.max_rank > triton.next_power_of_2(stack.max_rank) * (2 if shape.mixture else 1):
                continue
            for groups in capacities:
                batch = _batch(shape, groups, stack.device)
                y = lora_shrink(x[:shape.tokens], stack, batch, compile_only=True)
                lora_expand(out[:shape.tokens], y, stack, batch, compile_only=True)
                requested += 2
    return requested


def _batch(shape: BatchShape, capacity: int, device: torch.device) -> LoRABatch:
    lens, slots = shape.segments()
    if shape.mixture:  # as the model runner builds them: no rank bound but the stack's (two adapters' ranks)
        return LoRABatch.build(lens, slots, device, capacity=max(1, capacity), max_group_len=shape.max_group_len,
                               mix_slot=1)
    return LoRABatch.build(lens, slots, device, capacity=max(1, capacity), max_group_len=shape.max_group_len,
                           max_rank=shape.max_rank, mean_rank=shape.max_rank / 4 if shape.mixed else None)
