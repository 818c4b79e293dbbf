"""The configurations a bucket's search times: stage 1's tile shapes, stage 2's warps and stages."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

import triton

from kernels import tiling
from kernels.tiling import Bucket, Config, ExpandConfig, ShrinkConfig
from kernels.tuner.batches import group_lens

# Stage 1 times every tile shape at these (num_warps, num_stages); stage 2 the shortlist over all.
STAGE1 = {"shrink": (4, 3), "expand": (4, 2)}
WARPS = (4, 8)
STAGES = {"shrink": (2, 3, 4), "expand": (1, 2)}
PIPELINE_STAGES = (2, 3, 4)  # expand's pipelined steps: prefetch depth + 1; stage 1 times the middle one
SHRINK_BLOCK_M, SHRINK_BLOCK_K, SPLIT_K = (16, 32, 64, 128), (64, 128, 256), (1, 2, 4, 8, 16, 32)
EXPAND_BLOCK_M, BLOCK_N, N_STEPS = (1, 16, 32, 64, 128), (32, 64, 128, 256), (1, 2, 4, 8)
# B-stationary expand tiles (block_m, block_n), over M_STEPS M-tiles, for groups of STATIONARY_MIN_GROUP tokens and up
STATIONARY_TILES = ((32, 128), (32, 256), (64, 128), (64, 256), (128, 128))
M_STEPS, STATIONARY_MIN_GROUP = (2, 4, 8), 128
RANK_BLOCKS, RANK_BLOCKS_FMA, SHRINK_BLOCK_K_FMA = (16, 32), (2, 4, 8, 16), (128, 256, 512)
Y_PLANES_CAP = 64 * 2**20  # bytes of shrink's partial-sum planes (split_k of them) one call may write
PROGRAMS = (33, 4224)  # shrink's split-K keeps the programs between ~1/4 and ~32 per SM of an H100/H200
MAX_TILE = 16384  # elements of a shrink x tile (expand: half an out tile) that still fit


def _max_block_m(group: int) -> int:
    """Rows past the group's tokens (rounded to a power of 2) would only be masked."""
    return max(16, triton.next_power_of_2(group))


def _row_tiles(candidates: Iterable[int], group: int) -> tuple[int, ...]:
    """Row tiles worth timing for groups of `group` tokens: none past the group but 64-row ones
    (Hopper's wgmma takes 64 rows: a 64-row expand tile beat a 16-row one on Hopper even for
    2-token groups), and none under half of it while it is small (each tile re-reads the
    adapter's weights); groups of hundreds of tokens take tiles from 32 rows up (weight re-reads
    then hit L2; splits bring parallelism)."""
    top = _max_block_m(group)
    return tuple(b for b in candidates if min(top // 2, 32) <= b <= max(top, 64))


def tile_shapes(bucket: Bucket) -> list[Config]:
    """Stage 1: the op's tile shapes worth timing, at STAGE1's warps and stages.

    Pruned by what measurement on Hopper never favoured: row tiles below half of a small group
    (they re-read the adapter's weights; `_row_tiles`), tiles past ~16K elements (out of shared
    memory or registers), K splits leaving fewer than ~1/4 or more than ~32 programs per SM, and
    splits whose y planes would slow expand (tiling.max_split).
    """
    warps, stages = STAGE1[bucket.op]
    groups, slices = len(group_lens(bucket)), len(bucket.out_sizes)
    if bucket.op == "shrink":
        shapes = []
        # One-token groups may also take 1-row tiles on CUDA cores, their ranks spread over programs
        # instead of (or as well as) K; a 1-row tile may even span all of K in one step, unsplit.
        rows = ((1,) if bucket.group == 1 else ()) + _row_tiles(SHRINK_BLOCK_M, bucket.group)
        plane_bytes = bucket.tokens * slices * bucket.block_r * 4
        for m in rows:
            chunks = [c for c in (RANK_BLOCKS_FMA if m == 1 else RANK_BLOCKS) if c < bucket.block_r]
            for rank_block in [0, *chunks]:
                tiles = groups * -(-bucket.group // m) * slices * (bucket.block_r // (rank_block or bucket.block_r))
                splits = [s for s in SPLIT_K if bucket.in_features >= s * SHRINK_BLOCK_K[0]
                          and s * plane_bytes <= Y_PLANES_CAP]
                fitting = [s for s in splits if PROGRAMS[0] <= tiles * s <= PROGRAMS[1]] or [
                    max(splits, key=lambda s: min(tiles * s, PROGRAMS[1]))]  # the most programs short of it
                capped = [s for s in splits if s <= tiling.max_split(bucket.block_r, bucket.group)] or [1]
                fitting = [s for s in fitting if s in capped] or [max(capped)]
                if m > 1:
                    shapes += [ShrinkConfig(m, k, s, warps, stages, rank_block) for k in SHRINK_BLOCK_K
                               for s in fitting if bucket.in_features >= s * k and m * k <= MAX_TILE]
                    continue
                whole_k = triton.next_power_of_2(bucket.in_features)  # one step, no split
                shapes += [ShrinkConfig(m, k, s, warps, stages, rank_block)
                           for k, ss in [*((k, fitting) for k in SHRINK_BLOCK_K_FMA), (whole_k, [1])]
                           for s in ss if (bucket.in_features >= s * k or k == whole_k)
                           and k * (rank_block or bucket.block_r) <= MAX_TILE // 2]
        return list(dict.fromkeys(shapes))  # whole_k may also be one of SHRINK_BLOCK_K_FMA
    widest = max(bucket.out_sizes)
    # 1-row tiles (CUDA-core multiply-sum) only for one-token groups. n_steps stops at the first
    # count whose span covers the widest slice: more steps would all be masked.
    # Tensor-core tiles taking several steps are also timed with pipelined steps. Groups of hundreds of
    # tokens also try B-stationary programs spanning M_STEPS tiles of the group.
    rows = (1, 16) if bucket.group == 1 else _row_tiles(EXPAND_BLOCK_M[1:], bucket.group)
    shapes = [ExpandConfig(m, n, steps, warps, stages)
              for m in rows for n in BLOCK_N if (n >= 64 or bucket.group == 1) and m * n <= 2 * MAX_TILE
              for steps in N_STEPS if steps == 1 or n * steps // 2 < widest]
    # (4 warps hold a 64 x 256 accumulator in 128 registers a thread: those tiles start at 8 warps.)
    stationary = [ExpandConfig(m, n, 1, 8 if m * n >= MAX_TILE else warps, PIPELINE_STAGES[1], m_steps=k)
                  for m, n in STATIONARY_TILES for k in M_STEPS if bucket.group >= max(STATIONARY_MIN_GROUP, m * k)]
    return shapes + [replace(c, num_stages=PIPELINE_STAGES[1], pipeline=True) for c in shapes
                     if c.block_m >= 16 and c.n_steps > 1] + stationary


def variants(op: str, best: Iterable[Config]) -> list[Config]:
    """Stage 2: each shortlisted shape over every num_warps x num_stages."""
    def stages(config: Config) -> tuple[int, ...]:
        pipelined = isinstance(config, ExpandConfig) and (config.pipeline or config.stationary)
        return PIPELINE_STAGES if pipelined else STAGES[op]
    return [replace(c, num_warps=w, num_stages=s) for c in best for w in WARPS for s in stages(c)]
