"""The warm-up's batch shapes cover every kernel variant a serving engine's batches can select.

A variant is what makes Triton compile anew: the table's configuration for the batch's bucket and
the constexprs derived from the batch (rank tile, one tile per group, gathered rows, group scan
size). Random engine-like batches (any lengths, slots, ranks up to the worker's limits) must each
select a variant that the warm-up's shapes select too. The compile itself runs on the GPU
(tests/gpu/test_kernels_cuda.py checks that no compile follows a warm-up).
"""

from __future__ import annotations

import random

import pytest
import torch

from kernels import NO_SLOT, LoRABatch, LoRAStack, tiling
from kernels.triton.lora_common import group_block, one_tile_per_group, rank_tile
from kernels.triton.lora_warmup import BatchShape, _batch, batch_shapes

TABLE = tiling.load_table("NVIDIA H200")  # the committed table: real configurations per bucket
PROJECTIONS = {"qkv": (4096, (4096, 4096, 4096)), "o": (4096, (4096,)), "down": (11008, (4096,))}


def variant(op: str, stack: LoRAStack, batch: LoRABatch) -> tuple:
    bucket = tiling.bucket_of(op, stack, batch)
    config = tiling.lookup(bucket, TABLE)
    return (bucket.key, config, rank_tile(stack, batch), one_tile_per_group(batch, config.block_m),
            batch.rows is not None, group_block(batch.capacity), batch.is_mixture)


def warmed_variants(stack: LoRAStack, max_tokens: int, capacity: int, mixture: bool = False) -> set[tuple]:
    capacities = {min(group_block(c), capacity) for c in range(1, capacity + 1)}
    return {variant(op, stack, _batch(shape, groups, "cpu")) for shape in batch_shapes(max_tokens, stack.max_rank, mixture)
            for groups in capacities for op in ("shrink", "expand")}


def random_batch(rng: random.Random, max_tokens: int, slots: int, max_rank: int, mixture: bool = False) -> LoRABatch:
    lens, owners = [], []
    budget = rng.choice([1, rng.randint(1, 64), rng.randint(1, max_tokens)])
    while sum(lens) < budget:
        lens.append(min(budget - sum(lens), rng.choice([1, 1, rng.randint(1, 40), rng.randint(1, max_tokens)])))
        owners.append(rng.choice([NO_SLOT, *range(slots)]))
    if all(o == NO_SLOT for o in owners):
        owners[0] = 0
    if mixture:  # as the model runner builds them: the stack's rank bound, twice (kernels/batch.py)
        return LoRABatch.build(lens, owners, "cpu", mix_slot=slots - 1)
    bound = rng.choice([8, 16, 24, 32, 48, 64, max_rank])
    return LoRABatch.build(lens, owners, "cpu", max_rank=bound, mean_rank=rng.choice([None, rng.uniform(1, bound)]))


@pytest.mark.parametrize(("max_tokens", "slots", "max_rank"), [(4096, 8, 64), (8192, 96, 128), (512, 4, 16)])
def test_random_engine_batches_select_only_warmed_variants(max_tokens: int, slots: int, max_rank: int) -> None:
    rng = random.Random(f"{max_tokens}-{slots}-{max_rank}")
    for name, (in_features, out_sizes) in PROJECTIONS.items():
        stack = LoRAStack.standalone(1, in_features, out_sizes, max_rank, torch.bfloat16, "meta")
        warmed = warmed_variants(stack, max_tokens, slots)
        for _ in range(150):
            batch = random_batch(rng, max_tokens, slots, max_rank)
            for op in ("shrink", "expand"):
                assert variant(op, stack, batch) in warmed, (name, op, batch.num_tokens, batch.max_group_len,
                                                             batch.seg_lens, batch.seg_slots)


@pytest.mark.parametrize(("max_tokens", "slots", "max_rank"), [(4096, 8, 64), (512, 4, 16)])
def test_random_mixture_batches_select_only_warmed_variants(max_tokens: int, slots: int, max_rank: int) -> None:
    """With merged mode on, the warm-up also covers mixture steps' variants (two adapters' ranks a group)."""
    rng = random.Random(f"mixture-{max_tokens}-{slots}-{max_rank}")
    for name, (in_features, out_sizes) in PROJECTIONS.items():
        stack = LoRAStack.standalone(1, in_features, out_sizes, max_rank, torch.bfloat16, "meta")
        warmed = warmed_variants(stack, max_tokens, slots, mixture=True)
        for _ in range(100):
            batch = random_batch(rng, max_tokens, slots, max_rank, mixture=True)
            for op in ("shrink", "expand"):
                assert variant(op, stack, batch) in warmed, (name, op, batch.num_tokens, batch.seg_lens)


def test_gathered_shape_interleaves_its_group_with_base_tokens() -> None:
    batch = _batch(BatchShape(tokens=32, max_group_len=8, max_rank=64, gather=True, mixed=False), 4, "cpu")
    assert batch.rows is not None and batch.max_group_len == 8 and batch.num_tokens == 32
    assert batch.rows.tolist() == [0, 1, 2, 3, 5, 6, 7, 8]  # slot 0's tokens skip base-only token 4
    contiguous = _batch(BatchShape(tokens=32, max_group_len=8, max_rank=64, gather=False, mixed=True), 4, "cpu")
    assert contiguous.rows is None and contiguous.capacity == 4
    stack = LoRAStack.standalone(1, 64, (64,), 64, torch.float32, "meta")
    assert tiling.bucket_of("shrink", stack, contiguous).mixed
