"""A bucket's representative batches: the group sizes and adapter ranks its candidates are timed on.

Real batches' groups differ in size, leave partial tiles and mix ranks; a configuration is kept
only if it does well on every representative batch of its bucket (kernels/tuner/search.py).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from kernels.tiling import TOKEN_POINTS, Bucket

MAX_GROUPS = 256  # distinct adapters in one batch at most: buckets with more groups never occur
SPREAD_QUARTERS = (4, 2, 3, 1)  # group sizes of a representative batch, in quarters of its largest
MIXED_SHIFTS = (2, 0, 4, 1, 3)  # ranks of a mixed-rank batch's groups in turn: block_r >> shift


def group_lens(bucket: Bucket) -> list[int]:
    """Tokens of each group of the bucket's representative batch (`spread_lens`)."""
    return spread_lens(bucket.tokens, bucket.group)


def spread_lens(tokens: int, group: int) -> list[int]:
    """Groups of a representative batch of `tokens`: the first holds `group` tokens, the next ones
    cycle through 1/2, 3/4, 1/4 and 1 of it, the last takes what is left. Real batches' groups
    differ in size and leave partial tiles; equal full groups made the tuner favour tiles that ran
    the kernel benchmark's prefill batches (random request lengths) much slower."""
    lens: list[int] = []
    while (left := tokens - sum(lens)) > 0:
        lens.append(min(left, max(1, group * SPREAD_QUARTERS[len(lens) % len(SPREAD_QUARTERS)] // 4)))
    return lens


def random_lens(tokens: int, group: int, count: int) -> list[int]:
    """`count` groups summing to `tokens`: the first holds `group` tokens, the others random sizes
    in [1, group] (weights uniform in [1/4, 1], so about the spread batch's mean), the same in
    every run and process."""
    assert 1 <= count and group * count >= tokens, (tokens, group, count)
    rng = random.Random(tokens * 65537 + group)
    rest = tokens - group
    weights = [rng.uniform(0.25, 1.0) for _ in range(count - 1)]
    lens = [min(group, max(1, int(w / sum(weights) * rest))) for w in weights]
    i = 0
    while (left := rest - sum(lens)) != 0:  # what rounding and clamping left, one token at a time
        step = 1 if left > 0 else -1
        if 1 <= lens[i] + step <= group:
            lens[i] += step
        i = (i + 1) % len(lens)
    return [group, *lens]


@dataclass(frozen=True)
class BatchShape:
    lens: list[int]   # tokens of each group
    ranks: list[int]  # rank of each group's adapter (on every slice), <= the bucket's block_r

    @property
    def mean_rank(self) -> float:
        """Ranks averaged over tokens, as LoRABatch.mean_rank."""
        return sum(n * r for n, r in zip(self.lens, self.ranks)) / sum(self.lens)


def mixed_ranks(block_r: int, groups: int) -> list[int]:
    """Ranks of a mixed-rank batch's groups: a quarter of block_r, block_r, 1/16, 1/2, 1/8 in turn
    (the first, largest group takes neither end), so the token-weighted mean stays near 0.3-0.4 of
    block_r, under tiling.MIXED_MEAN_RANK."""
    return [max(1, block_r >> MIXED_SHIFTS[g % len(MIXED_SHIFTS)]) for g in range(groups)]


def batch_shapes(bucket: Bucket) -> list[BatchShape]:
    """The bucket's representative batches: the spread batch (`group_lens`), every adapter of rank
    block_r, and, where groups may differ in size, a batch of random group sizes (`random_lens`, at
    most MAX_GROUPS groups) twice: every adapter of rank block_r, then ranks block_r, block_r/2,
    block_r/4, block_r/8 in turn (a batch whose largest rank is r holds lower ones too).

    Random sizes keep the tuner off configurations that only fit the spread batch: its 8192 tokens
    in 64-row tiles make 128 programs, one wave on 132 SMs, and the configuration chosen for it (one
    CTA an SM) runs random-length prefills (137-144 tiles: each group adds a partial tile) in a
    second wave. Mixed ranks let rank blocks win where they pay; equal ranks show what they cost
    (each block re-reads x): timed on mixed ranks alone, a rank block's programs past low ranks exit
    early and hid a second wave that slowed uniform-rank prefills. Where the largest group is the
    whole batch (G = T) the spread batch is one group, so the random batches' largest group is the
    smallest that still rounds up to G: a 2048-token prefill of four adapters lands in the same
    bucket as one of a single adapter, and ran markedly slower on the single adapter's configuration.

    Where several groups of G fit, two even batches bound how many groups the bucket's batches
    hold (`even_lens`): T / G groups of G tokens, the fewest, and groups of one token more than the
    token point under G, the most. Decode batches whose requests spread evenly over adapters come
    so. At a few hundred tokens an expand reads more adapter weights than activations, so its best
    tiles move with the group count: entries tuned on the spread and random batches alone (1.6-3x
    T / G groups) ran the kernel benchmark's even decode batches slower than the static
    configuration, and entries tuned with the fewest-groups batch added but not the most lost on
    many groups of 2 tokens (figures: docs/benchmarks/kernels.md).

    A mixed-rank bucket (tiling.is_mixed) times the spread, random and even batches on `mixed_ranks`
    only: its batches are known to mix ranks, which is what lets rank blocks or wider tiles win."""
    def ranks(groups: int) -> list[int]:
        return mixed_ranks(bucket.block_r, groups) if bucket.mixed else [bucket.block_r] * groups

    spread = group_lens(bucket)
    # A mixed-rank bucket's spread batch of one group (G = T) cannot mix ranks: it is left out.
    shapes = [BatchShape(spread, ranks(len(spread)))] if len(spread) > 1 or not bucket.mixed else []
    if bucket.group == 1:  # one-token groups: nothing to vary
        return shapes
    smallest = max(p for p in TOKEN_POINTS if p < bucket.group) + 1  # the least largest group of G
    if bucket.group < bucket.tokens:
        largest, count = bucket.group, 2 * len(spread)
    else:
        largest, count = smallest, len(spread_lens(bucket.tokens, smallest))
    lens = random_lens(bucket.tokens, largest, min(count, MAX_GROUPS, bucket.tokens - largest + 1))
    shapes.append(BatchShape(lens, ranks(len(lens))))
    if not bucket.mixed:  # whether ranks mix is unknown: the same sizes with lower ranks too
        shapes.append(BatchShape(lens, [max(1, bucket.block_r >> (g % 4)) for g in range(len(lens))]))
    if bucket.group < bucket.tokens:
        for size in (bucket.group, smallest):
            even = even_lens(bucket.tokens, size)
            shapes.append(BatchShape(even, ranks(len(even))))
    return shapes


def even_lens(tokens: int, size: int) -> list[int]:
    """Groups of `size` tokens, the last one what is left; larger ones if that makes over MAX_GROUPS."""
    size = max(size, -(-tokens // MAX_GROUPS))
    return [min(size, tokens - start) for start in range(0, tokens, size)]


def segments(lens: Sequence[int]) -> tuple[list[int], list[int]]:
    """(tokens of each segment, its group) of a batch of groups of `lens` tokens: with several
    groups, each group of 2+ tokens comes as two halves, every first half before every second
    half, so no such group is contiguous and the kernels gather its rows, as for a batch whose
    requests alternate adapters. Example, groups (4, 2, 1): segments (2, 1, 1, 2, 1) of groups
    (0, 1, 2, 0, 1)."""
    if len(lens) == 1:
        return list(lens), [0]
    halves = [(n - n // 2, g) for g, n in enumerate(lens)] + [(n // 2, g) for g, n in enumerate(lens) if n >= 2]
    return [n for n, _ in halves], [g for _, g in halves]
