"""`python -m kernels.tune`: time the LoRA kernels' tile configurations per shape bucket on this GPU
and write the table kernels/tuning.py looks up (kernels/tables/<gpu>.json).

    python -m kernels.tune --model llama-7b qwen2-7b --dry-run   # buckets, candidate counts; no GPU
    python -m kernels.tune --model llama-7b --time-budget 500    # stops cleanly, keeps what is done
    python -m kernels.tune --model llama-7b --skip-tuned         # goes on where a budgeted run stopped

A bucket (tuning.Bucket) is one op on one fused projection of the model, a rank tile block_r, a
batch of T tokens and a largest group of G. It is timed on representative batches (`batch_shapes`):
T tokens in groups of spread sizes (`spread_lens`) and of random sizes (`random_lens`), their rows
interleaved (`segments`), each group its own adapter slot targeting every slice. The configuration
kept is the one whose worst time over those batches, relative to the best on each, is least
(`regrets`). The full grid of configurations is ~10x too large to time, so the search has two
stages: tile shapes at fixed warps/stages, then the SHORTLIST best shapes over warps x stages. The
heuristic's choice is always timed as well: an entry is never worse than no entry.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from concurrent.futures import ProcessPoolExecutor
from datetime import date
from functools import partial
from itertools import accumulate
from multiprocessing import get_context
from pathlib import Path
from typing import TextIO

import torch
import triton

from kernels import reference, timing, triton_lora, tuning
from kernels.batch import NO_SLOT, LoRABatch
from kernels.lora_stack import LoRAStack
from kernels.tuning import Bucket, Config, ExpandConfig, ShrinkConfig

OPS = ("shrink", "expand")
MAX_GROUPS = 256  # distinct adapters in one batch at most: buckets with more groups never occur
SPREAD_QUARTERS = (4, 2, 3, 1)  # group sizes of a representative batch, in quarters of its largest
MIXED_SHIFTS = (2, 0, 4, 1, 3)  # ranks of a mixed-rank batch's groups in turn: block_r >> shift
MEMORY_CAP = 20 * 10**9  # bytes of rotating inputs (stack slots included) one bucket may allocate
MAX_COPIES = 1024  # rotating copies at most (a graph of as many calls). With 32, tiny ops ran with
# their weights in L2 and the tuner ranked their configurations unlike the kernel benchmark
PROJECTIONS = ("o", "qkv", "gate_up", "down")
SHORTLIST = 2  # stage-1 shapes that go on to stage 2
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
TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 4e-3, torch.float32: 1e-4}  # vs the float32 reference


class CheckFailed(Exception):
    """A bucket's heuristic configuration disagrees with the reference (or cannot run): not tuned."""


class BudgetSpent(Exception):
    """The --time-budget ran out in the middle of a bucket."""


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int

    def projections(self) -> dict[str, tuple[int, tuple[int, ...]]]:
        """name -> (in_features, out slices), fused as the engine runs them."""
        h, i = self.hidden, self.intermediate
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return {"qkv": (h, (q, kv, kv)), "o": (q, (h,)), "gate_up": (h, (i, i)), "down": (i, (h,))}


PRESETS = {
    "llama-7b": ModelShape(hidden=4096, intermediate=11008, heads=32, kv_heads=32, head_dim=128),
    "qwen2-7b": ModelShape(hidden=3584, intermediate=18944, heads=28, kv_heads=4, head_dim=128),
}


def model_shape(spec: str) -> ModelShape:
    """A preset's name, or a local HF model directory / config.json (read, never fetched)."""
    if spec in PRESETS:
        return PRESETS[spec]
    path = Path(spec)
    path = path / "config.json" if path.is_dir() else path
    if not path.is_file():
        raise ValueError(f"{spec!r} is neither a preset ({', '.join(PRESETS)}) nor a local config.json")
    config = json.loads(path.read_text())
    if "hidden_size" not in config:  # vision-language configs nest the language model's
        config = config.get("text_config", config)
    try:
        heads = config["num_attention_heads"]
        return ModelShape(hidden=config["hidden_size"], intermediate=config["intermediate_size"], heads=heads,
                          kv_heads=config.get("num_key_value_heads") or heads,
                          head_dim=config.get("head_dim") or config["hidden_size"] // heads)
    except KeyError as exc:
        raise ValueError(f"{path} has no {exc.args[0]}") from None


def token_groups(tokens: Iterable[int], groups: Iterable[int] = tuning.TOKEN_POINTS) -> list[tuple[int, int]]:
    """(T, G) pairs: G one of `groups` (token points) <= T, and at most MAX_GROUPS groups in the
    representative batch."""
    groups = set(groups)
    return [(t, g) for t in tokens for g in tuning.TOKEN_POINTS
            if g in groups and g <= t and len(spread_lens(t, g)) <= MAX_GROUPS]


def buckets(models: Sequence[ModelShape], ops: Sequence[str], ranks: Sequence[int],
            tokens: Sequence[int], names: Sequence[str] = PROJECTIONS, mixed: bool = False,
            groups: Sequence[int] = tuning.TOKEN_POINTS) -> list[Bucket]:
    """Every bucket of the models' projections named (shared shapes once): all shrink buckets, then
    all expand buckets (an expand is tuned on the y planes its shrink's tuned split writes).
    `mixed`: their mixed-rank variants instead (tuning.is_mixed); `groups`: largest-group sizes G kept."""
    projections = dict.fromkeys(shape for name in names for model in models
                                for shape in [model.projections()[name]])
    return [Bucket(op, k, sizes, r, t, g, mixed) for op in ops for k, sizes in projections for r in ranks
            for t, g in token_groups(tokens, groups)]


def group_lens(bucket: Bucket) -> list[int]:
    """Tokens of each group of the bucket's representative batch (`spread_lens`)."""
    return spread_lens(bucket.tokens, bucket.group)


def spread_lens(tokens: int, group: int) -> list[int]:
    """Groups of a representative batch of `tokens`: the first holds `group` tokens, the next ones
    cycle through 1/2, 3/4, 1/4 and 1 of it, the last takes what is left. Real batches' groups
    differ in size and leave partial tiles; equal full groups made the tuner favour tiles that the
    kernel benchmark's prefill batches (random request lengths) ran up to 2x slower."""
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
    block_r, under tuning.MIXED_MEAN_RANK."""
    return [max(1, block_r >> MIXED_SHIFTS[g % len(MIXED_SHIFTS)]) for g in range(groups)]


def batch_shapes(bucket: Bucket) -> list[BatchShape]:
    """The bucket's representative batches: the spread batch (`group_lens`), every adapter of rank
    block_r, and, where groups may differ in size, a batch of random group sizes (`random_lens`, at
    most MAX_GROUPS groups) twice: every adapter of rank block_r, then ranks block_r, block_r/2,
    block_r/4, block_r/8 in turn (a batch whose largest rank is r holds lower ones too).

    Random sizes keep the tuner off configurations that only fit the spread batch: its 8192 tokens
    in 64-row tiles make 128 programs, one wave on 132 SMs, and the configuration chosen for it (one
    CTA an SM) ran the kernel benchmark's random-length prefills (137-144 tiles: each group adds a
    partial tile) 1.7x slower on an H200, as a second wave would. Mixed ranks let rank blocks win
    where they pay; equal ranks show what they cost (each block re-reads x): timed on mixed ranks
    alone, a rank block's programs past low ranks exit early and hid a second wave that ran a
    4-adapter rank-64 prefill 1.5x slower. Where the largest group is the whole batch (G = T) the
    spread batch is one group, so the random batches' largest group is the smallest that still
    rounds up to G: a 2048-token prefill of four adapters lands in the same bucket as one of a
    single adapter, and an H200 ran it 1.5x slower on the single adapter's configuration.

    Where several groups of G fit, two even batches bound how many groups the bucket's batches
    hold (`even_lens`): T / G groups of G tokens, the fewest, and groups of one token more than the
    token point under G, the most. Decode batches whose requests spread evenly over adapters come
    so. At a few hundred tokens an expand reads more adapter weights than activations, so its best
    tiles move with the group count. On an H200, entries tuned on the spread and random batches
    alone (1.6-3x T / G groups; by earlier kernels too) ran the kernel benchmark's even decode
    batches up to 1.6x slower than the static configuration, and entries tuned with the
    fewest-groups batch added but not the most ran 64 groups of 2 tokens 1.3x slower than before.

    A mixed-rank bucket (tuning.is_mixed) times the spread, random and even batches on `mixed_ranks`
    only: its batches are known to mix ranks, which is what lets rank blocks or wider tiles win."""
    def ranks(groups: int) -> list[int]:
        return mixed_ranks(bucket.block_r, groups) if bucket.mixed else [bucket.block_r] * groups

    spread = group_lens(bucket)
    # A mixed-rank bucket's spread batch of one group (G = T) cannot mix ranks: it is left out.
    shapes = [BatchShape(spread, ranks(len(spread)))] if len(spread) > 1 or not bucket.mixed else []
    if bucket.group == 1:  # one-token groups: nothing to vary
        return shapes
    smallest = max(p for p in tuning.TOKEN_POINTS if p < bucket.group) + 1  # the least largest group of G
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


def _max_block_m(group: int) -> int:
    """Rows past the group's tokens (rounded to a power of 2) would only be masked."""
    return max(16, triton.next_power_of_2(group))


def _row_tiles(candidates: Iterable[int], group: int) -> tuple[int, ...]:
    """Row tiles worth timing for groups of `group` tokens: none past the group but 64-row ones
    (Hopper's wgmma takes 64 rows: on an H200 a 64-row expand tile beat a 16-row one even for
    2-token groups), and none under half of it while it is small (each tile re-reads the
    adapter's weights); groups of hundreds of tokens take tiles from 32 rows up (weight re-reads
    then hit L2; splits bring parallelism)."""
    top = _max_block_m(group)
    return tuple(b for b in candidates if min(top // 2, 32) <= b <= max(top, 64))


def tile_shapes(bucket: Bucket) -> list[Config]:
    """Stage 1: the op's tile shapes worth timing, at STAGE1's warps and stages.

    Pruned by what measurement on an H200 never favoured: row tiles below half of a small group
    (they re-read the adapter's weights; `_row_tiles`), tiles past ~16K elements (out of shared
    memory or registers), K splits leaving fewer than ~1/4 or more than ~32 programs per SM, and
    splits whose y planes would slow expand (tuning.max_split).
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
                capped = [s for s in splits if s <= tuning.max_split(bucket.block_r, bucket.group)] or [1]
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


def search(bucket: Bucket, measure: Callable[[Config], Sequence[float]], deadline: float,
           on_failure: Callable[[Config, Exception], None]) -> dict:
    """The bucket's table entry: the chosen configuration's fields, its mean time over the batch
    shapes ("us", likewise "heuristic_us"), its time on each ("shape_us") and its "regret".

    measure(config) -> seconds per call on each of the bucket's batch shapes. The choice is the
    configuration whose worst time over the shapes, relative to the best any configuration took on
    that shape, is least (`regrets`): one configuration serves every batch of the bucket. A
    configuration `measure` fails on (out of shared memory, ...) is reported and skipped. Raises
    BudgetSpent once time.monotonic() passes `deadline`.
    """
    heuristic = tuning.heuristic_config(bucket)
    seconds: dict[Config, tuple[float, ...]] = {}
    failed: set[Config] = set()

    def time_all(configs: Iterable[Config]) -> None:
        for config in configs:
            if config in seconds or config in failed:
                continue
            if time.monotonic() > deadline:
                raise BudgetSpent
            try:
                seconds[config] = tuple(measure(config))
            except Exception as exc:  # a config that cannot compile or run is a loser, not an error
                failed.add(config)
                on_failure(config, exc)

    def ranked(configs: Iterable[Config]) -> list[Config]:
        regret = regrets(seconds)
        return sorted((c for c in configs if c in seconds), key=lambda c: (regret[c], statistics.fmean(seconds[c])))

    stage1 = tile_shapes(bucket)
    time_all([heuristic, *stage1])
    if heuristic not in seconds:
        raise CheckFailed(f"{bucket.key}: the heuristic {heuristic} could not be timed")
    time_all(variants(bucket.op, ranked(stage1)[:SHORTLIST]))
    winner = ranked(seconds)[0]
    return {**tuning.config_dict(winner), "us": round(statistics.fmean(seconds[winner]) * 1e6, 3),
            "heuristic_us": round(statistics.fmean(seconds[heuristic]) * 1e6, 3),
            "regret": round(regrets(seconds)[winner], 3),
            "shape_us": [round(t * 1e6, 3) for t in seconds[winner]]}


def regrets(seconds: dict[Config, tuple[float, ...]]) -> dict[Config, float]:
    """Each configuration's worst ratio, over the batch shapes, of its time to the least time any
    configuration took on that shape. Example: times (10, 30) and (12, 24) -> regrets 1.25, 1.2."""
    best = [min(times) for times in zip(*seconds.values())]
    return {config: max(t / b for t, b in zip(times, best)) for config, times in seconds.items()}


def shrink_splits(bucket: Bucket, old: dict | None, new: dict[str, dict]) -> int:
    """The K split the shrink of `bucket`'s shape runs with (the table as tuned so far, else the
    heuristic): expand is tuned on as many y planes as that shrink writes. 1 for shrink buckets."""
    if bucket.op == "shrink":
        return 1
    configs = {**(old or {}).get("configs", {}), **new}
    return tuning.lookup(replace(bucket, op="shrink"), {"configs": configs}).split_k


def copy_bytes(bucket: Bucket, elem_size: int, splits: int = 1) -> tuple[int, int]:
    """(bytes one call moves, bytes one input copy allocates: its activations and its stack slots)."""
    t, k, r, n = bucket.tokens, bucket.in_features, bucket.block_r, sum(bucket.out_sizes)
    slices, groups = len(bucket.out_sizes), max(len(shape.lens) for shape in batch_shapes(bucket))
    y = splits * t * slices * r * (4 if splits > 1 else elem_size)  # float32 planes, or one (triton_lora.y_dtype)
    a, b = groups * slices * r * k * elem_size, groups * n * r * elem_size
    if bucket.op == "shrink":  # reads x and A, writes y
        return t * k * elem_size + a + y, t * k * elem_size + a + b
    return y + b + 2 * t * n * elem_size, y + t * n * elem_size + a + b  # reads y, B, out; writes out


def rotation_copies(bucket: Bucket, elem_size: int, splits: int = 1,
                    needed: Callable[[int], int] = timing.copies_needed) -> int:
    """Input copies to cycle through: for each batch shape, enough to span 3x L2 on their own (each
    shape is timed apart), few enough to stay under MEMORY_CAP."""
    moved, allocated = copy_bytes(bucket, elem_size, splits)
    wanted = needed(moved) * len(batch_shapes(bucket))
    return max(1, min(wanted, MEMORY_CAP // allocated, MAX_COPIES))


def random_stack(bucket: Bucket, ranks: Sequence[int], dtype: torch.dtype, device: torch.device | str,
                 generator: torch.Generator) -> LoRAStack:
    """A slot for each of `ranks`, padded to block_r, that rank on every slice; unit-variance
    products (the kernels never read past a slot's rank)."""
    slices, r, k = len(bucket.out_sizes), bucket.block_r, bucket.in_features
    new = partial(torch.randn, dtype=dtype, device=device, generator=generator)
    return LoRAStack(a=new(len(ranks), slices, r, k).mul_(k ** -0.5),
                     b=new(len(ranks), r, sum(bucket.out_sizes)).mul_(r ** -0.5),
                     ranks=torch.tensor(ranks, dtype=torch.int32, device=device)[:, None].repeat(1, slices),
                     scalings=torch.ones(len(ranks), dtype=torch.float32, device=device),
                     out_offsets=(0, *accumulate(bucket.out_sizes)),
                     host_ranks=[[rank] * slices for rank in ranks])


@dataclass(eq=False)  # holds tensors
class Workload:
    """A bucket's representative batches (`batch_shapes`), taken in turn by `copies` copies. Copy c
    has its own activations and its own slot range of one shared stack, so cycling the copies
    moves weights (most of a decode op's bytes) and activations alike through more than the L2."""
    bucket: Bucket
    stack: LoRAStack             # [copies * groups] slots, groups: the most of any shape
    batches: list[LoRABatch]     # copy c: shape c % shapes' segments, group i on slot c * groups + i
    inputs: list[torch.Tensor]   # shrink: x [T, in_features]; expand: y [splits, T, slices, block_r] (y_dtype)
    outs: list[torch.Tensor]     # expand: out [T, out_features]; shrink: none

    @staticmethod
    def build(bucket: Bucket, copies: int, dtype: torch.dtype, device: torch.device | str, seed: int = 0,
              splits: int = 1) -> Workload:
        """`splits`: expand's y planes, as the shrink configuration of the same shape writes them."""
        generator = torch.Generator(device=device).manual_seed(seed)
        kinds = batch_shapes(bucket)
        shapes = [kinds[c % len(kinds)] for c in range(copies)]
        groups = max(len(shape.lens) for shape in shapes)
        # Copy c's slots: its shape's ranks, then rank-0 slots no group uses (padding to `groups`).
        ranks = [rank for shape in shapes for rank in [*shape.ranks, *[0] * (groups - len(shape.ranks))]]
        stack = random_stack(bucket, ranks, dtype, device, generator)
        batches = []
        for c, shape in enumerate(shapes):
            seg_lens, seg_groups = segments(shape.lens)
            # One capacity for all: every copy runs the same compiled kernel over the same grid.
            batches.append(LoRABatch.build(seg_lens, [c * groups + g for g in seg_groups], device, capacity=groups,
                                           mean_rank=shape.mean_rank if bucket.mixed else None))
        t, slices, out_features = bucket.tokens, len(bucket.out_sizes), sum(bucket.out_sizes)
        new = partial(torch.randn, device=device, generator=generator)
        if bucket.op == "shrink":
            inputs, outs = [new(t, bucket.in_features, dtype=dtype) for _ in batches], []
        else:
            inputs = [new(splits, t, slices, bucket.block_r, dtype=triton_lora.y_dtype(splits, dtype)) for _ in batches]
            outs = [new(t, out_features, dtype=dtype) for _ in batches]
        work = Workload(bucket, stack, batches, inputs, outs)
        assert all(tuning.bucket_of(bucket.op, stack, b) == bucket for b in batches), bucket  # lookup finds it
        return work

    def call(self, config: Config, copy: int, compile_only: bool = False) -> Callable[[], object]:
        if self.bucket.op == "shrink":
            return partial(triton_lora.lora_shrink, self.inputs[copy], self.stack, self.batches[copy], config,
                           compile_only)
        return partial(triton_lora.lora_expand, self.outs[copy], self.inputs[copy], self.stack, self.batches[copy],
                       config, compile_only)

    def seconds(self, config: Config) -> tuple[float, ...]:
        """Seconds per call on each batch shape: one graph over the copies of each."""
        shapes = min(len(self.batches), len(batch_shapes(self.bucket)))
        return tuple(timing.graph_time_s([self.call(config, c) for c in range(shape, len(self.batches), shapes)])
                     for shape in range(shapes))

    def check(self, config: Config) -> None:
        """`config` on the first copy of each shape against the float32 reference on float32 copies
        of its inputs."""
        checked = min(len(self.batches), len(batch_shapes(self.bucket)))
        slots = checked * self.stack.num_slots // len(self.batches)  # those copies' slots
        s = self.stack
        exact = LoRAStack(s.a[:slots].float(), s.b[:slots].float(), s.ranks[:slots], s.scalings[:slots],
                          s.out_offsets, s.host_ranks[:slots])
        for copy in range(checked):
            batch, x = self.batches[copy], self.inputs[copy]
            try:
                if self.bucket.op == "shrink":
                    got = triton_lora.lora_shrink(x, s, batch, config).sum(0, keepdim=True)
                    want = reference.lora_shrink(x.float(), exact, batch)
                    got = torch.where(_specified(s, batch), got, 0.0)  # the reference's zeros
                else:
                    got, want = self.outs[copy].clone(), self.outs[copy].float()
                    triton_lora.lora_expand(got, x, s, batch, config)
                    reference.lora_expand(want, x, exact, batch)
            except Exception as exc:
                raise CheckFailed(f"{self.bucket.key}: {config} failed to run: {_first_line(exc)}") from exc
            tol, scale = TOLERANCE[s.a.dtype], want.abs().max().item()
            if not torch.allclose(got.float(), want, rtol=tol, atol=tol * scale):
                error = (got.float() - want).abs().nan_to_num(math.inf).max().item()
                raise CheckFailed(f"{self.bucket.key}: {config} is off the reference by {error:.3g} "
                                  f"(scale {scale:.3g}, batch shape {copy})")


def _specified(stack: LoRAStack, batch: LoRABatch) -> torch.Tensor:
    """[1, tokens, slices, max_rank] bool: the entries of y that lora_shrink defines (columns under
    the rank of the token's adapter on that slice)."""
    ranks = torch.zeros(batch.num_tokens, stack.num_slices, dtype=torch.int64)
    for start, n, slot in zip(batch.seg_starts, batch.seg_lens, batch.seg_slots):
        if slot != NO_SLOT:
            ranks[start:start + n] = torch.tensor(stack.host_ranks[slot])
    return (torch.arange(stack.max_rank) < ranks[..., None])[None].to(stack.a.device)


def static_configs(configs: dict[str, dict]) -> dict[str, dict]:
    """Per op, the configuration that wins the most buckets (ties: the lower total time over them):
    the fixed-tiling baseline of the benchmarks. One config must run every shape, so it is taken
    among tensor-core tiles (a 1-row tile re-reads the weights for every token of a prefill), and
    shrink's is unsplit (the planes of a split widen every expand's y tile; rank 128: past shared
    memory). Mixed-rank entries do not vote: their shapes are counted once, unmixed."""
    won: dict[tuple[str, Config], list[float]] = {}
    for key, entry in configs.items():
        if key.endswith("|mixed"):
            continue
        op = key.split("|", 1)[0]
        config = tuning.config_from(op, entry)
        if config.block_m == 1 or (isinstance(config, ShrinkConfig) and config.split_k > 1):
            continue
        won.setdefault((op, config), []).append(entry["us"])
    best: dict[str, tuple[tuple[int, float], Config]] = {}
    for (op, config), times in won.items():
        score = (len(times), -sum(times))
        if op not in best or score > best[op][0]:
            best[op] = (score, config)
    return {op: tuning.config_dict(config) for op, (_, config) in sorted(best.items())}


def merged_table(old: dict | None, new: dict[str, dict], header: dict) -> dict:
    """This run's entries over the old table's (None: start afresh); static configs recomputed."""
    old = old or {}
    configs = dict(sorted({**old.get("configs", {}), **new}.items()))
    runs = [*old.get("runs", []), {"date": header["date"], "command": header["command"]}]
    return {**header, "runs": runs, "static": static_configs(configs), "configs": configs}


def untuned(todo: Iterable[Bucket], table: dict | None) -> list[Bucket]:
    return [b for b in todo if b.key not in (table or {}).get("configs", {})]


def expands_on_heuristic_splits(todo: Sequence[Bucket], table: dict | None) -> list[Bucket]:
    """Expand buckets whose shrink neither the table nor this run tunes: they are timed on the
    heuristic shrink's y planes. Right for this table as a whole; wrong for entries copied into
    another table, whose shrinks may split differently (an H200 ran such an expand 1.4x slower)."""
    tuned = {b.key for b in todo if b.op == "shrink"} | set((table or {}).get("configs", {}))
    return [b for b in todo if b.op == "expand" and replace(b, op="shrink").key not in tuned]


def read_table(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def write_table(path: Path, table: dict) -> None:
    """Atomically: a reader (or a crash) sees the old table or the new one, never half of one."""
    text = json.dumps(table, indent=1) + "\n"  # serialize before touching the disk
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class Progress:
    """`[done/total] elapsed, ETA  current item` on stderr: redrawn in place on a terminal, one line
    per update otherwise (logs). Notes print above it."""

    def __init__(self, total: int, stream: TextIO | None = None, clock: Callable[[], float] = time.monotonic):
        self.total, self.stream, self.clock = total, stream or sys.stderr, clock
        self.start, self.line, self.tty = clock(), "", self.stream.isatty()

    def show(self, done: int, label: str) -> None:
        elapsed = self.clock() - self.start
        eta = _hms(elapsed / done * (self.total - done)) if done else "?"
        self.line = f"[{done}/{self.total}] {_hms(elapsed)} elapsed, ETA {eta}  {label}"
        self.stream.write(f"\r\x1b[K{self.line}" if self.tty else f"{self.line}\n")
        self.stream.flush()

    def note(self, text: str) -> None:
        self.stream.write(f"\r\x1b[K{text}\n{self.line}" if self.tty else f"{text}\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")


def _hms(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def _first_line(exc: Exception) -> str:
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"


def print_plan(todo: Sequence[Bucket]) -> None:
    """--dry-run: each bucket's timings (stage 1 with the heuristic; stage 2 at most), and totals."""
    total1 = total2 = 0
    for bucket in todo:
        stage1 = tile_shapes(bucket)
        n1 = len(stage1) + (tuning.heuristic_config(bucket) not in stage1)
        n2 = (len(WARPS) * len(STAGES[bucket.op]) - 1) * min(SHORTLIST, len(stage1))  # less stage 1's setting
        total1, total2 = total1 + n1, total2 + n2
        print(f"{bucket.key}  stage1 {n1}  stage2 <={n2}")
    per_op = ", ".join(f"{op} {sum(b.op == op for b in todo)}" for op in OPS)
    print(f"{len(todo)} buckets ({per_op}); timings: stage 1 {total1}, stage 2 <={total2}")


def tune(args: argparse.Namespace, todo: list[Bucket], command: str) -> int:
    device = torch.device("cuda")
    gpu = torch.cuda.get_device_name(device)
    path = args.table or tuning.TABLE_DIR / f"{tuning.gpu_slug(gpu)}.json"
    old = read_table(path) if args.merge else None
    if old and (old.get("triton"), old.get("torch")) != (triton.__version__, torch.__version__):
        print(f"note: merging into {path}, tuned with triton {old.get('triton')}, torch {old.get('torch')}",
              file=sys.stderr)
    if args.skip_tuned:
        todo = untuned(todo, old)
    if heuristic_splits := expands_on_heuristic_splits(todo, old):
        print(f"note: {len(heuristic_splits)} expand buckets have no shrink entry in {path}: they are timed on the "
              "heuristic shrink's K split; merge this table whole, not entry by entry", file=sys.stderr)
    header = {"gpu": gpu, "capability": tuning.capability_of(torch.cuda.current_device()),  # kin GPUs use it
              "triton": triton.__version__, "torch": torch.__version__,
              "date": date.today().isoformat(), "command": command}
    dtype = getattr(torch, args.dtype)
    elem_size = torch.empty((), dtype=dtype).element_size()
    progress = Progress(len(todo))
    failures: dict[str, int] = {}  # distinct failure note -> count: each is printed once

    def on_failure(config: Config, exc: Exception) -> None:
        note = f"skipped {config}: {_first_line(exc)}"
        if note not in failures:
            progress.note(note)
        failures[note] = failures.get(note, 0) + 1

    def tune_bucket(bucket: Bucket) -> bool:
        """Time `bucket` into `new` (or `broken`); False once the time budget is spent."""
        splits = shrink_splits(bucket, old, new)
        work = Workload.build(bucket, rotation_copies(bucket, elem_size, splits), dtype, device, splits=splits)
        try:
            work.check(tuning.heuristic_config(bucket))  # a broken kernel is never tuned
            new[bucket.key] = search(bucket, work.seconds, deadline, on_failure)
        except CheckFailed as exc:
            broken.append(bucket.key)
            progress.note(f"NOT TUNED {exc}")
        except BudgetSpent:
            return False
        finally:
            del work
            torch.cuda.empty_cache()
        return True

    deadline = time.monotonic() + args.time_budget
    new: dict[str, dict] = {}
    broken: list[str] = []
    with ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn")) as pool:
        for op in OPS:  # all shrink buckets first: each expand is tuned on its shrink's splits
            op_todo = [b for b in todo if b.op == op]
            if time.monotonic() > deadline:
                break
            # Workers compile each bucket's candidates ahead of the timing, which then finds them
            # in Triton's on-disk cache: compiling, not timing, is most of a tuning run.
            compiled = {b: pool.submit(compile_candidates, b, args.dtype, shrink_splits(b, old, new)) for b in op_todo}
            try:
                for bucket in op_todo:
                    if time.monotonic() > deadline:
                        break
                    progress.show(len(new) + len(broken), bucket.key)
                    if compiled[bucket].exception() is not None:  # a dead worker: the timing compiles
                        progress.note(f"compiling ahead failed for {bucket.key}: {_first_line(compiled[bucket].exception())}")
                    if not tune_bucket(bucket):
                        break
                    write_table(path, merged_table(old, new, header))
            finally:
                for future in compiled.values():
                    future.cancel()
    left = len(todo) - len(new) - len(broken)
    progress.show(len(todo) - left, "stopped: time budget spent" if left else "done")
    progress.close()
    print(f"tuned {len(new)} of {len(todo)} buckets on {gpu}"
          + (f"; {left} left: time budget spent, go on with --skip-tuned" if left else ""))
    print_summary(path, new, broken, failures)
    return 1 if broken else 0


def compile_candidates(bucket: Bucket, dtype: str, splits: int) -> None:
    """Worker: compile the bucket's heuristic and stage-1 candidates for its one-copy workload
    without launching them (the GPU stays the timing's alone), which leaves them in Triton's
    on-disk cache. One that fails to compile is skipped here; the timing reports it."""
    work = Workload.build(bucket, 1, getattr(torch, dtype), "cuda", splits=splits)
    for config in dict.fromkeys([tuning.heuristic_config(bucket), *tile_shapes(bucket)]):
        try:
            work.call(config, 0, compile_only=True)()
        except Exception:  # noqa: BLE001 - e.g. out of shared memory; timing it will say so
            pass


def print_summary(path: Path, new: dict[str, dict], broken: list[str], failures: dict[str, int]) -> None:
    if new:
        speedups = [e["heuristic_us"] / e["us"] for e in new.values()]
        print(f"winner vs heuristic: median speedup {statistics.median(speedups):.2f}x, max {max(speedups):.2f}x")
        table = read_table(path)
        for op, config in table["static"].items():
            print(f"static {op}: {config}")
        print(f"wrote {path} ({len(table['configs'])} buckets)")
    if failures:
        print(f"{sum(failures.values())} timings skipped ({len(failures)} distinct failures, on stderr)")
    if broken:
        print(f"CHECK FAILED, not tuned ({len(broken)}): {' '.join(broken)}")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m kernels.tune", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", nargs="+", required=True, metavar="NAME|PATH",
                        help=f"presets ({', '.join(PRESETS)}) or local HF model directories / config.json files")
    parser.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
    parser.add_argument("--projections", nargs="+", choices=PROJECTIONS, default=list(PROJECTIONS))
    parser.add_argument("--ranks", nargs="+", type=int, default=list(tuning.RANK_POINTS),
                        help="rank tiles to tune, of tuning.RANK_POINTS (default: all)")
    parser.add_argument("--tokens", nargs="+", type=int, default=list(tuning.TOKEN_POINTS),
                        help="batch sizes T to tune, of tuning.TOKEN_POINTS (default: all)")
    parser.add_argument("--groups", nargs="+", type=int, default=list(tuning.TOKEN_POINTS),
                        help="largest-group sizes G to tune, of tuning.TOKEN_POINTS (default: all)")
    parser.add_argument("--mixed", action="store_true",
                        help="tune the buckets' mixed-rank variants (batches whose mean rank is known to be low)")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--merge", action=argparse.BooleanOptionalAction, default=True,
                        help="keep the table's entries of other buckets (default: on)")
    parser.add_argument("--skip-tuned", action="store_true", help="leave buckets the table has alone")
    parser.add_argument("--table", type=Path, help="table to write (default: kernels/tables/<gpu>.json)")
    parser.add_argument("--time-budget", type=float, default=math.inf, metavar="SECONDS",
                        help="stop when spent, keeping the buckets done (default: none)")
    parser.add_argument("--jobs", type=int, default=max(1, min(16, (os.cpu_count() or 2) - 1)),
                        help="processes compiling candidates ahead of the timing (default: CPUs - 1, <= 16)")
    parser.add_argument("--dry-run", action="store_true", help="list buckets and candidate counts; no GPU")
    args = parser.parse_args(argv)
    if not set(args.ranks) <= set(tuning.RANK_POINTS):
        parser.error(f"--ranks must be of tuning.RANK_POINTS {tuning.RANK_POINTS}: lookup rounds to those")
    for name in ("tokens", "groups"):
        if not set(getattr(args, name)) <= set(tuning.TOKEN_POINTS):
            parser.error(f"--{name} must be of tuning.TOKEN_POINTS {tuning.TOKEN_POINTS}: lookup rounds to those")
    if args.skip_tuned and not args.merge:
        parser.error("--skip-tuned keeps the table's entries: it needs --merge")
    try:
        args.models = [model_shape(spec) for spec in args.model]
    except ValueError as exc:
        parser.error(str(exc))
    args.ops, args.ranks, args.tokens = list(dict.fromkeys(args.ops)), sorted(set(args.ranks)), sorted(set(args.tokens))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    todo = buckets(args.models, args.ops, args.ranks, args.tokens, args.projections, args.mixed, args.groups)
    if args.dry_run:  # sizing a continued run needs the table named: without a GPU its name is unknown
        print_plan(untuned(todo, read_table(args.table)) if args.skip_tuned and args.table else todo)
        return 0
    if not torch.cuda.is_available():
        print("kernels.tune times kernels on a CUDA GPU; none here (--dry-run needs none)", file=sys.stderr)
        return 2
    return tune(args, todo, shlex.join(["python", "-m", "kernels.tune", *argv]))


if __name__ == "__main__":
    sys.exit(main())
