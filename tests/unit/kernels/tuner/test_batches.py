"""kernels.tuner.batches: a bucket's representative batches (group sizes, interleaved rows, ranks)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kernels import tiling
from kernels.batch import LoRABatch
from kernels.tiling import Bucket
from kernels.tuner.batches import MAX_GROUPS, BatchShape, batch_shapes, group_lens, segments
from kernels.tuner.buckets import token_groups
from kernels.tuner.workload import Workload


def test_representative_groups_spread_below_the_largest_and_sum_to_the_tokens():
    for tokens, group in token_groups(tiling.TOKEN_POINTS):
        lens = group_lens(Bucket("expand", 64, (32,), 16, tokens, group))
        assert sum(lens) == tokens and max(lens) == lens[0] == group and min(lens) >= 1
        if tokens >= 4 * group >= 16:  # partial tiles: groups of several sizes
            assert len(set(lens)) >= 3
    assert group_lens(Bucket("shrink", 64, (32,), 16, 8, 1)) == [1] * 8  # decode: one token each


def test_representative_segments_interleave_each_groups_rows():
    lens = group_lens(Bucket("expand", 64, (32,), 16, 60, 16))
    seg_lens, seg_groups = segments(lens)
    assert [sum(n for n, g in zip(seg_lens, seg_groups) if g == i) for i in range(len(lens))] == lens
    assert all(a != b for a, b in zip(seg_groups, seg_groups[1:]))  # no group's segments touch
    batch = LoRABatch.build(seg_lens, seg_groups, "cpu")
    assert batch.rows is not None and batch.max_group_len == 16  # the kernels gather; the bucket holds
    assert segments([32]) == ([32], [0])  # one group: contiguous


def test_random_batch_shape_sums_to_the_tokens_with_the_spread_count_and_unaligned_tiles():
    for tokens, group in token_groups(tiling.TOKEN_POINTS):
        bucket = Bucket("shrink", 64, (32,), 16, tokens, group)
        shapes = batch_shapes(bucket)
        previous = tiling.TOKEN_POINTS[tiling.TOKEN_POINTS.index(group) - 1] if group > 1 else 0
        assert shapes[0].lens == group_lens(bucket) and set(shapes[0].ranks) == {16}
        assert batch_shapes(bucket) == shapes  # deterministic
        if group == 1:  # nothing to vary: one-token groups
            assert len(shapes) == 1
            continue
        spread, rand = shapes[0].lens, shapes[1].lens
        assert sum(rand) == tokens and min(rand) >= 1 and len(rand) <= MAX_GROUPS
        assert tiling.round_up(max(rand), tiling.TOKEN_POINTS) == group  # the same bucket
        if group < tokens:
            assert rand[0] == max(rand) == group
            assert len(spread) <= len(rand) <= 2 * len(spread)  # more partial tiles
        else:  # the spread batch is one group; the random one has several, the largest just in the bucket
            assert len(spread) == 1 and rand[0] == max(rand) == previous + 1 and len(rand) >= tokens / (previous + 1)
        assert shapes[2].lens == rand  # the same sizes, ranks equal then mixed
        assert shapes[1].ranks == [16] * len(rand)
        assert shapes[2].ranks[:4] == [16, 8, 4, 2][:len(rand)] and len(shapes[2].ranks) == len(rand)
        if group < tokens:  # and even batches of the fewest and the most groups the bucket allows
            assert len(shapes) == 5 and shapes[3] == BatchShape([group] * (tokens // group), [16] * (tokens // group))
            fewest, most = shapes[3].lens, shapes[4].lens
            assert len(fewest) < len(spread) and sum(most) == tokens and len(most) <= MAX_GROUPS
            assert tiling.round_up(max(most), tiling.TOKEN_POINTS) == group and len(set(most[:-1])) == 1
            assert len(most) == min(MAX_GROUPS, -(-tokens // (previous + 1))) and shapes[4].ranks == [16] * len(most)
        else:
            assert len(shapes) == 3
    # The case that motivated it: 8192 tokens in groups of <= 2048 fill 64-row tiles exactly when
    # spread, not when random.
    spread, rand = batch_shapes(Bucket("shrink", 64, (32,), 16, 8192, 2048))[:2]
    assert sum(-(-n // 64) for n in spread.lens) == 128 < sum(-(-n // 64) for n in rand.lens)


@pytest.mark.parametrize("tokens,group", [(2048, 512), (8192, 8192), (512, 1)])
def test_mixed_rank_buckets_time_only_batches_that_mix_ranks(tokens, group):
    """Every batch shape of a mixed-rank bucket has groups of several ranks, a token-weighted mean
    under tiling.MIXED_MEAN_RANK of the rank tile, and its workload's batches look the bucket up."""
    bucket = Bucket("shrink", 64, (32,), 128, tokens, group, mixed=True)
    shapes = batch_shapes(bucket)
    plain = batch_shapes(replace(bucket, mixed=False))
    assert len(shapes) == (1 if group in (1, tokens) else 4) and len(plain) == (1 if group == 1 else 3 if group == tokens else 5)
    for shape in shapes:
        assert len(set(shape.ranks)) == min(5, len(shape.lens)) and max(shape.ranks) == 128 and min(shape.ranks) == 8
        assert shape.mean_rank < tiling.MIXED_MEAN_RANK * 128
        assert shape.lens in [p.lens for p in plain]  # the same group sizes as the unmixed bucket's
    if group < tokens:
        work = Workload.build(bucket, copies=2, dtype=torch.float32, device="cpu")
        assert all(b.mean_rank is not None and tiling.bucket_of("shrink", work.stack, b) == bucket
                   for b in work.batches)
