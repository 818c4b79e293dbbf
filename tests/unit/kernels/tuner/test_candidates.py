"""kernels.tuner.candidates: the tile shapes of stage 1 and the warps x stages of stage 2 respect their
constraints."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kernels import tiling
from kernels.tiling import Bucket, ExpandConfig, ShrinkConfig
from kernels.tuner.candidates import (MAX_TILE, PIPELINE_STAGES, STAGES, STATIONARY_MIN_GROUP, WARPS, Y_PLANES_CAP,
                                      tile_shapes, variants)


@pytest.mark.parametrize("bucket", [Bucket("shrink", 4096, (4096, 1024, 1024), 16, 1, 1),
                                    Bucket("shrink", 11008, (4096,), 128, 8192, 128),
                                    Bucket("shrink", 96, (32,), 64, 32, 8),
                                    Bucket("shrink", 4096, (4096,), 16, 2048, 2048)], ids=lambda b: b.key)
def test_shrink_candidates_respect_their_constraints(bucket):
    configs = tile_shapes(bucket)
    assert configs and len(set(configs)) == len(configs)
    top = max(16, 1 << (bucket.group - 1).bit_length())
    for c in configs:
        whole_k = c.block_k >= bucket.in_features  # a 1-row tile over all of K in one step
        if c.block_m == 1:  # CUDA-core tiles: one-token groups only, ranks spread over programs
            assert bucket.group == 1 and c.rank_block in (0, 2, 4, 8, 16)
            assert c.block_k in (128, 256, 512) or (whole_k and c.split_k == 1 and c.block_k < 2 * bucket.in_features)
            assert c.block_k * (c.rank_block or bucket.block_r) <= MAX_TILE // 2
        else:
            assert c.block_m in (16, 32, 64, 128) and min(top // 2, 32) <= c.block_m <= max(top, 64)  # wgmma: 64
            assert c.block_k in (64, 128, 256) and c.block_m * c.block_k <= MAX_TILE
            assert c.rank_block in (0, 16, 32) and c.rank_block < bucket.block_r
        assert c.split_k in (1, 2, 4, 8, 16, 32) and (bucket.in_features / c.split_k >= c.block_k or whole_k)
        assert c.split_k * bucket.tokens * len(bucket.out_sizes) * bucket.block_r * 4 <= Y_PLANES_CAP
        assert (c.num_warps, c.num_stages) == (4, 3)
    for c in configs:  # the y planes expand sums in each program: a capped tile
        assert c.split_k == 1 or c.split_k * bucket.block_r * min(bucket.group, 64) <= tiling.PLANE_TILE_CAP
    if bucket.in_features == 4096 and bucket.group == 1:  # 3 tiles (q, k, v): splits 16 and 32 fit the window
        assert {1, 16, 32} <= {c.split_k for c in configs}  # 1: whole-K 1-row tiles
        assert {c.block_m for c in configs} == {1, 16, 32, 64}  # 64: a wgmma tile
        assert ShrinkConfig(1, 4096, 1, 4, 3, rank_block=2) in configs  # whole K, unsplit
    if bucket.group == 2048:  # one long group: row tiles from 32 up, K split for parallelism
        assert {c.block_m for c in configs} == {32, 64, 128} and max(c.split_k for c in configs) == 8


@pytest.mark.parametrize("bucket", [Bucket("expand", 4096, (4096, 4096, 4096), 16, 8, 1),
                                    Bucket("expand", 3584, (3584, 512, 512), 64, 512, 128),
                                    Bucket("expand", 64, (48, 16), 16, 32, 8)], ids=lambda b: b.key)
def test_expand_candidates_respect_their_constraints(bucket):
    configs = tile_shapes(bucket)
    assert configs and len(set(configs)) == len(configs)
    top = max(16, 1 << (bucket.group - 1).bit_length())
    for c in configs:
        assert c.block_m in (1, 16, 32, 64, 128) and c.block_m <= max(top, 64)
        assert (c.block_m == 1) <= (bucket.group == 1)  # 1-row tiles only for one-token groups
        assert c.block_n in (32, 64, 128, 256) and c.n_steps in (1, 2, 4, 8)
        assert c.n_steps == 1 or c.block_n * c.n_steps // 2 < max(bucket.out_sizes)  # no all-masked steps
        if c.pipeline:  # the twin of a plain tensor-core shape of several steps
            assert c.block_m >= 16 and c.n_steps > 1 and (c.num_warps, c.num_stages) == (4, PIPELINE_STAGES[1])
            assert replace(c, num_stages=2, pipeline=False) in configs
        elif c.stationary:  # B-stationary: M spans inside the group, and 8 warps for the widest accumulators
            assert bucket.group >= max(STATIONARY_MIN_GROUP, c.block_m * c.m_steps) and c.n_steps == 1
            assert (c.num_warps, c.num_stages) == (8 if c.block_m * c.block_n >= MAX_TILE else 4, PIPELINE_STAGES[1])
        else:
            assert (c.num_warps, c.num_stages) == (4, 2)
    assert (bucket.group == 1) == any(c.block_m == 1 for c in configs)
    assert (bucket.group >= STATIONARY_MIN_GROUP) == any(c.stationary for c in configs)
    assert any(c.pipeline for c in configs) == any(c.block_m >= 16 and c.n_steps > 1 for c in configs)
    if bucket.out_sizes == (48, 16):  # slices this narrow: one step of any block_n covers them
        assert {c.n_steps for c in configs} == {1} and {c.block_m for c in configs} == {16, 32, 64}


def test_variants_cover_warps_and_stages_of_each_shortlisted_shape():
    best = [ShrinkConfig(16, 64, 8, 4, 3), ShrinkConfig(32, 128, 1, 4, 3)]
    out = variants("shrink", best)
    assert len(out) == len(set(out)) == 2 * len(WARPS) * len(STAGES["shrink"])
    assert {(c.block_m, c.block_k, c.split_k) for c in out} == {(16, 64, 8), (32, 128, 1)}
    assert {(c.num_warps, c.num_stages) for c in variants("expand", [ExpandConfig(1, 64, 4, 4, 2)])} == {
        (w, s) for w in (4, 8) for s in (1, 2)}
    pipelined = variants("expand", [ExpandConfig(16, 64, 4, 4, 3, pipeline=True)])
    assert {(c.num_warps, c.num_stages, c.pipeline) for c in pipelined} == {
        (w, s, True) for w in (4, 8) for s in PIPELINE_STAGES}
